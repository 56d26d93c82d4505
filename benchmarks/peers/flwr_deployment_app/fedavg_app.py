"""FedAvg on the peers workload as a Flower app for the Deployment Engine (flwr 1.42, Message API).

Run by benchmarks/peers_runtime.py through `flwr run` against a SuperLink and SuperNodes it starts; the SuperLink
and SuperNodes import this module from the app's FAB, and `peer_common` from benchmarks/peers (on their
PYTHONPATH), in the flwr venv.

- Each SuperNode hosts the clients its node config names (`partitions`, e.g. "0,3,6"; the same clients a dfca
  worker of the same ordinal hosts: client c on node c % nodes). A `train` message to a node carries the global
  model; its ClientApp trains each hosted client in turn (peer_common.local_sgd, one torch thread) and replies with
  one model per client, so a round moves the same models as one client a node does, in fewer messages.
- The ServerApp sends every round's messages with `Grid.send_and_receive`, averages the clients' models weighted by
  their sample counts (FedAvg), and notes the wall time (time.time()) at the start and at the end of every round.
  After the last round it measures the final model on every client's test samples and writes a JSON result file
  (`result` in the run config): round marks, accuracy, payload bytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from peer_common import accuracy, client_seed, load, local_sgd, mlp, setup_torch

client = ClientApp()
server = ServerApp()


def hosted(context: Context) -> list[int]:
    return [int(c) for c in str(context.node_config["partitions"]).split(",") if c.strip()]


@client.train()
def train(msg: Message, context: Context) -> Message:
    setup_torch(1)
    w = load(str(context.run_config["data"]))
    seed, round_ = int(w.meta["seed"]), int(msg.content["config"]["round"])
    model = mlp(seed, int(w.meta["hidden"]))
    content = RecordDict()
    counts: dict[str, int] = {}
    for c in hosted(context):
        model.load_state_dict(msg.content["model"].to_torch_state_dict())
        x, y = w.train_of(c)
        local_sgd(model, x, y, w.meta, client_seed(seed, round_, c))
        content[f"model.{c}"] = ArrayRecord(model.state_dict())
        counts[f"examples.{c}"] = int(x.shape[0])
    content["metrics"] = MetricRecord(counts)
    return Message(content=content, reply_to=msg)


def payload_bytes(record: ArrayRecord) -> int:
    return sum(len(array.data) for array in record.values())


@server.main()
def main(grid: Grid, context: Context) -> None:
    setup_torch(1)
    w = load(str(context.run_config["data"]))
    rounds, nodes = int(context.run_config["rounds"]), int(context.run_config["nodes"])
    model = mlp(int(w.meta["seed"]), int(w.meta["hidden"]))
    deadline = time.monotonic() + 600
    while len(node_ids := list(grid.get_node_ids())) < nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(node_ids)} of {nodes} SuperNodes connected")
        time.sleep(0.05)
    marks, sent, received = [time.time()], 0, 0
    for r in range(1, rounds + 1):
        record = ArrayRecord(model.state_dict())
        messages = [Message(content=RecordDict({"model": record, "config": ConfigRecord({"round": r})}),
                            message_type="train", dst_node_id=node) for node in node_ids]
        replies = list(grid.send_and_receive(messages))
        sent += payload_bytes(record) * len(messages)
        totals: dict[str, torch.Tensor] = {}
        examples = 0
        for reply in replies:
            if reply.has_error():
                raise RuntimeError(f"round {r}: a ClientApp failed: {reply.error}")
            counts = reply.content["metrics"]
            for key, value in reply.content.items():
                if not key.startswith("model."):
                    continue
                n = int(counts[f"examples.{key.removeprefix('model.')}"])
                received += payload_bytes(value)
                examples += n
                for name, tensor in value.to_torch_state_dict().items():
                    totals[name] = totals.get(name, 0) + tensor * n
        if examples != w.clients * w.x_train.shape[1]:
            raise RuntimeError(f"round {r}: {examples} training samples answered, expected every client's")
        model.load_state_dict({name: total / examples for name, total in totals.items()})
        marks.append(time.time())
    result = {"round_marks": marks, "test_accuracy": accuracy(model, *w.test_set()), "nodes": len(node_ids),
              "payload_bytes_sent": sent, "payload_bytes_received": received,
              "flwr_version": __import__("flwr").__version__, "numpy": np.__version__}
    Path(str(context.run_config["result"])).write_text(json.dumps(result))
