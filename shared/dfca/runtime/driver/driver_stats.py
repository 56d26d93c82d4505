"""What a message driver counts: messages by outcome, rejections by reason (logged a few lines a round), and where
a round's time goes."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# Where a round's time goes (DriverStats.seconds, cumulative): train = the algorithm's begin_round (assignment and
# local training); publish = send, encode and publish, and at the round's end awaiting the publisher confirms that
# have not come yet (an exchange's messages are handed over without waiting for them); receive = checking, decoding
# and folding what arrived; wait = the rest of collecting (nothing to do: waiting on neighbours or the broker);
# mix = end_exchange and end_round (a gossip step's mixing, the losses for the next assignment); checkpoint = what a
# worker's round loop spends on the round's checkpoint (copying the state, waiting for the write before; the runner's).
# DriverStats.cpu_seconds: the same phases' CPU time of the thread that runs them (the round loop's), and `loop`: that
# thread's CPU time over whole rounds (what it spends beyond the phases: the runner's round reports and controls).
PHASES = ("train", "publish", "receive", "wait", "mix", "checkpoint")
# Warnings about rejected messages logged per round; the rest are counted (DriverStats.rejected) and summed up in one
# line at the round's end, so a flood of junk cannot flood the logs (or spend a worker's time writing them).
LOGGED_REJECTIONS_PER_ROUND = 10


@dataclass
class DriverStats:
    published: int = 0
    delivered: int = 0  # messages the broker delivered to the driver's queue (one a message however many rows hear it)
    applied: int = 0  # (receiver, message) pairs the algorithm used
    ignored: int = 0  # delivered, but of no use to the algorithm (FedSPD: another cluster)
    duplicates: int = 0
    stale_dropped: int = 0
    stale_merged: int = 0
    not_neighbour: int = 0
    timeouts: int = 0  # exchanges closed by their deadline
    screened: int = 0  # (gossip arrival, cluster) pairs screened gossip dropped
    blocked: int = 0  # senders cut off for flooding malformed messages
    republished: int = 0  # models the host published again after a new connection (a restarted broker lost them)
    rejected: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # per phase, see PHASES
    cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*PHASES, "loop"), 0.0))

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("rejected", "seconds", "cpu_seconds")}
        out["rejected"] = dict(self.rejected)
        out["seconds"] = dict(self.seconds)
        out["cpu_seconds"] = dict(self.cpu_seconds)
        out["rejected_total"] = sum(self.rejected.values())
        return out

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall-clock and thread CPU time of the block to `phase`."""
        began, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - began
            self.cpu_seconds[phase] += time.thread_time() - cpu

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Add the block's time, less what `receive` took of it, to `wait` (where it ends normally)."""
        began, received = time.perf_counter(), self.seconds["receive"]
        cpu, received_cpu = time.thread_time(), self.cpu_seconds["receive"]
        yield
        self.seconds["wait"] += time.perf_counter() - began - (self.seconds["receive"] - received)
        self.cpu_seconds["wait"] += time.thread_time() - cpu - (self.cpu_seconds["receive"] - received_cpu)


class RejectionLog:
    """Warnings about rejected messages: the first `per_round` of a round are logged one by one, the rest counted
    and summed up in one line at the round's end."""

    def __init__(self, log: logging.Logger, per_round: int = LOGGED_REJECTIONS_PER_ROUND) -> None:
        self.log, self.per_round = log, per_round
        self.logged = 0
        self.unlogged = 0

    def begin_round(self) -> None:
        self.logged = 0

    def warn(self, text: str, *args: Any) -> None:
        """Log a rejection, or count it once this round's `per_round` are logged."""
        if self.logged < self.per_round:
            self.logged += 1
            self.log.warning(text, *args)
        else:
            self.unlogged += 1

    def end_round(self, t: int) -> None:
        """The line that sums up the round's rejections not logged one by one, if any."""
        if self.unlogged:
            self.log.warning("round %d: %d more rejected messages not logged one by one (see the rejected counts)",
                             t, self.unlogged)
            self.unlogged = 0
