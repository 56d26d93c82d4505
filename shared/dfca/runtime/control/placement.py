"""Workers that hold their own data: what they register, which registrations are refused, and where each client goes.

A worker started on a data folder (`--data DIR`, DFCA_DATA_DIR) registers `DataHoldings` with the topology service:
its client ids, their sample counts, the input shape, the number of classes and, where the folder has clusters.json,
its clients' true clusters; never the data. An experiment with `data.source: workers` runs over the clients that the
registered workers hold: `place` gives them global indices 0..N-1 in the order of their ids and says which worker
hosts each (a `Placement`). Everything here is pure: the coordinator keeps the state and acts on the answers.
"""

from __future__ import annotations

from collections.abc import Mapping

from dfca.config import ExperimentConfig
from dfca.runtime.protocol.holdings import DataHoldings, Placement
from dfca.sections import ExperimentBase


class PlacementError(ValueError):
    """No placement can be made from the registered workers; the message names the workers and clients."""


def listed(names: list[str], most: int = 5) -> str:
    """Up to `most` names, quoted, and how many more ("none" for none)."""
    if not names:
        return "none"
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def registration_refusal(ordinal: int, holdings: DataHoldings, registered: Mapping[int, DataHoldings],
                         placed: Mapping[int, tuple[str, Placement]]) -> str | None:
    """Why worker `ordinal`'s registration is refused, or None.

    `registered`: the other workers' accepted holdings; `placed`: per ordinal, an experiment not yet over that placed
    clients on that worker, and its placement. Refused: a client id listed twice, a client another worker holds, and,
    for a worker an experiment placed clients on, other clients than placed, or data that no longer fits its model."""
    ids = holdings.ids
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        return f"worker {ordinal} lists client {listed(twice)} twice"
    for other, theirs in sorted(registered.items()):
        if other == ordinal:
            continue
        shared = sorted(set(ids) & set(theirs.ids))
        if shared:
            return (f"worker {ordinal} ({holdings.folder}) holds client {listed(shared)}, which worker {other} "
                    f"({theirs.folder}) holds too: a client's data lives on one worker")
    if ordinal in placed:
        experiment, placement = placed[ordinal]
        expected = placement.ids_of(ordinal)
        if sorted(ids) != expected:
            gained = sorted(set(ids) - set(expected))
            lost = sorted(set(expected) - set(ids))
            change = "; ".join(part for part in (f"new {listed(gained)}" if gained else "",
                                                 f"missing {listed(lost)}" if lost else "") if part)
            return (f"worker {ordinal} was restarted with other clients than experiment {experiment} placed on it "
                    f"({change}); start it on its earlier folder, or stop {experiment} first")
        misfit = fit_refusal(ordinal, holdings, placement.input_shape, placement.num_classes)
        if misfit:
            return f"{misfit} (experiment {experiment})"
    return None


def fit_refusal(ordinal: int, holdings: DataHoldings, input_shape: list[int], num_classes: int) -> str | None:
    """Why worker `ordinal`'s data does not fit a model made for `input_shape` and `num_classes`, or None."""
    if holdings.input_shape != input_shape:
        return (f"worker {ordinal} ({holdings.folder}) holds samples of shape {tuple(holdings.input_shape)}, "
                f"the experiment's model takes {tuple(input_shape)}")
    if holdings.num_classes > num_classes:
        return (f"worker {ordinal} ({holdings.folder}) has labels up to {holdings.num_classes - 1}, the experiment's "
                f"model has {num_classes} classes")
    return None


def place(registered: Mapping[int, DataHoldings], classes: int | None = None) -> Placement:
    """Every registered client, indexed in the order of their ids, on the worker that holds it, for a model of
    `classes` classes (`data.classes`; None: the most any worker has). PlacementError when nobody registered data,
    the workers' sample shapes differ, or a worker has labels beyond `classes`."""
    if not registered:
        raise PlacementError("data.source is workers but no worker holding data has registered: start workers "
                             "with --data DIR (or DFCA_DATA_DIR)")
    ordinals = sorted(registered)
    first = ordinals[0]
    for ordinal in ordinals[1:]:
        misfit = fit_refusal(ordinal, registered[ordinal], registered[first].input_shape, 1_000_000)
        if misfit:
            raise PlacementError(f"{misfit} of worker {first} ({registered[first].folder})")
    if classes is not None:
        for ordinal in ordinals:
            misfit = fit_refusal(ordinal, registered[ordinal], registered[ordinal].input_shape, classes)
            if misfit:
                raise PlacementError(f"{misfit} (data.classes)")
    facts = sorted(((c, o) for o in ordinals for c in registered[o].clients), key=lambda pair: pair[0].id)
    clusters = [c.cluster for c, _ in facts]
    return Placement(
        client_ids=[c.id for c, _ in facts], hosts=[o for _, o in facts], train_counts=[c.train for c, _ in facts],
        true_clusters=None if any(k is None for k in clusters) else [int(k) for k in clusters if k is not None],
        input_shape=list(registered[first].input_shape),
        num_classes=classes if classes is not None else max(registered[o].num_classes for o in ordinals),
    )


def data_on_workers(cfg: ExperimentBase) -> bool:
    """Whether an experiment runs over the clients its workers hold (`data.source: workers`)."""
    return cfg.data.source == "workers"


def placed_config(cfg: ExperimentConfig, placement: Placement) -> ExperimentConfig:
    """The experiment's config with `data.clients` set to the placed clients' count."""
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"clients": placement.num_clients})})
