"""Admission: whether a message delivered to a driver's queue is let in, and whose messages no longer are.

Admission decides, the driver acts (acknowledges, rejects, unbinds); nothing here touches a Transport.
- the sender's host: a model's routing key must name the principal hosting its sender (client c on worker
  c % workers, a central role on the aggregator) and, where the driver's own broker user is a principal's, the
  broker-proven publisher must be that principal
  (dfca.identity.principals); a copy of a hosted client's message (which the
  driver delivered itself) is acknowledged unread;
- cut-off: where publishers are proven, a sender under whose key BLOCK_AFTER_INVALID malformed messages, or as many
  repeats of messages already used, came in one round is `blocked` for the rest of the run (the broker's own
  redeliveries do not count, nor, once per message, a copy its host published again after a new connection to the
  broker, `resent`; without proven publishers anyone could frame an honest client, so nobody is);
- near rounds: a model is let in only once its round is near: at most NEAR_ROUNDS after the furthest round the run
  has reached as the receiver knows it (its own round, and the rounds of messages let in from every *other* host
  than the sender's), and never more than MAX_ROUNDS_AHEAD after its own round (`future_round`). A host cannot
  vouch for itself, so models a worker sends for rounds the others have not reached (pre-sent lies, to be the first
  copy when the round comes) are refused, and forged rounds cannot pile up in memory;
- equivocation: two different bodies (their checksums) for the same (sender, round, exchange, step, part) are
  `equivocation`: counted, the later one refused and, where publishers are proven, the sender `blocked` for the rest
  of the run. An honest sender sends each message once (the broker's redeliveries and a restarted worker's repeats
  are the same bytes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from dfca.algorithms.base import SERVER
from dfca.identity import principals, topics
from dfca.wire.codec import Envelope

# A live neighbour is a round or two ahead at most (it waits for this client's messages, or a deadline, in every
# exchange), but one that presumed this client dead (a restarted worker) runs on: its messages are held for when
# this client catches up. Beyond this many rounds a message is rejected and counted (`future_round`): forged rounds
# cannot pile up. (Measured: at 3, a worker restarted at round 4 recovered by timeouts only and its run took more
# than 5 minutes instead of 1.5.)
MAX_ROUNDS_AHEAD = 20
# Malformed messages from one proven sender in one round after which it is cut off. An honest client sends a few
# valid messages per round and never a malformed one; a flood sends thousands.
BLOCK_AFTER_INVALID = 20
# How far ahead of the run's furthest round (as hosts other than the sender's prove it) a model may be. An honest
# neighbour waits for this client's models (or a deadline) before it moves on, so it is at most one round ahead of the
# slowest host it hears: its next round's models may arrive while this client still folds the current one. A
# neighbour that ran on while this client's worker was down or paused is ahead, but then so are the other hosts,
# and their models, queued meanwhile, vouch for the rounds it reached.
NEAR_ROUNDS = 1


class Screening(Enum):
    """A message let in before it is decoded."""

    DECODE = "decode"  # let in: decode it
    LOCAL_COPY = "local_copy"  # a copy of a hosted client's message, delivered in the process: acknowledged unread


@dataclass(frozen=True)
class Refusal:
    """A message refused: dead-lettered and counted under `reason` (DriverStats.rejected); `detail` says why."""

    reason: str
    detail: str


def model_key_of(routing_key: str) -> topics.ModelKey | None:
    """The routing key parsed (topics.parse_model_key), None where it is malformed."""
    try:
        return topics.parse_model_key(routing_key)
    except ValueError:
        return None


class Admission:
    """The gate of one driver's queue: `workers` share the clients, `hosted` are the driver's own, `own_user` is the
    broker user it connects as (a principal's: publishers are proven); `hosts`: the worker ordinal of each client
    where workers hold their own data (dfca.runtime.protocol.holdings.Placement), else client c is on c % workers."""

    def __init__(self, workers: int, own_user: str, hosted: Iterable[int] = (),
                 max_rounds_ahead: int = MAX_ROUNDS_AHEAD, block_after: int = BLOCK_AFTER_INVALID,
                 near_rounds: int = NEAR_ROUNDS, hosts: Sequence[int] | None = None) -> None:
        self.workers = workers
        self.hosts = hosts
        self.publishers = principals.PublisherCheck(own_user)
        self.hosted = set(hosted)
        self.max_rounds_ahead, self.block_after, self.near_rounds = max_rounds_ahead, block_after, near_rounds
        self.invalid: Counter[int] = Counter()  # sender -> malformed or repeated messages under its key this round
        self.blocked: set[int] = set()  # senders cut off for the rest of the run
        self.reached: dict[str, int] = {}  # host -> the furthest round of a model let in from it
        self.bodies = BodyLedger()
        self.forgiven: set[MessageIdentity] = set()  # messages whose repeat was let off as published again

    def host_of(self, sender: int) -> str:
        """The principal hosting `sender`."""
        if sender == SERVER:
            return principals.AGGREGATOR
        if self.hosts is not None:
            return principals.worker(self.hosts[sender]) if 0 <= sender < len(self.hosts) else "unknown"
        return principals.host_of(sender, self.workers)

    def begin_round(self) -> None:
        """Counts against senders are per round."""
        self.invalid.clear()

    def screen(self, routing_key: str, publisher: str) -> Screening | Refusal:
        """Before decoding: a hosted sender's copy, one not published by its sender's host (`publisher`), or one to
        decode."""
        key = model_key_of(routing_key)
        if key is not None and key.sender in self.hosted:
            return Screening.LOCAL_COPY
        if not self.from_senders_host(key, publisher):
            return Refusal("publisher", f"published by {publisher!r}, not by its sender's host")
        return Screening.DECODE

    def from_senders_host(self, key: topics.ModelKey | None, publisher: str) -> bool:
        """The routing key (`key`, parsed) names the sender's host, and (where publishers are proven) the host
        published it. A malformed key (None) passes here: the decoder rejects it."""
        if key is None:
            return True
        host = self.host_of(key.sender)
        return key.host == host and self.publishers.allows(publisher, host)

    def admit_round(self, sender: int, claimed_round: int, current_round: int) -> Refusal | None:
        """A decoded message of `sender` for `claimed_round` at `current_round`: refused (`future_round`) unless its
        round is near (NEAR_ROUNDS) and within MAX_ROUNDS_AHEAD of this receiver's."""
        if claimed_round > current_round + self.max_rounds_ahead:
            return Refusal("future_round", f"round {claimed_round} at round {current_round}: more than "
                                           f"{self.max_rounds_ahead} rounds ahead")
        host = self.host_of(sender)
        reached = max([current_round, *(r for h, r in self.reached.items() if h != host)])
        if claimed_round > reached + self.near_rounds:
            return Refusal("future_round", f"round {claimed_round} from {host} before the run is near it (round "
                                           f"{reached} at most, as other hosts than {host} show)")
        self.reached[host] = max(claimed_round, self.reached.get(host, claimed_round))
        return None

    def equivocation(self, identity: MessageIdentity, digest: str) -> Refusal | None:
        """A body (its checksum `digest`) for `identity` that differs from the one already let in is refused
        (`equivocation`); the driver then cuts the sender off where publishers are `proven`."""
        if self.bodies.same_or_first(identity, digest):
            return None
        return Refusal("equivocation", f"client {identity[0]} sent two different bodies for round {identity[1]} "
                                       f"{identity[2]} step {identity[3]} part {identity[4]}")

    def resent(self, identity: MessageIdentity) -> bool:
        """A repeat of `identity` that its sender's host says it published again after a new connection to the broker
        (which may have restarted and lost it) does not count against the sender, as the broker's redelivery does
        not: True the first time for each message, False after (a flood of such copies counts)."""
        if identity in self.forgiven:
            return False
        self.forgiven.add(identity)
        return True

    def end_round(self, current_round: int) -> None:
        """Bodies of rounds before `current_round` - 1 are forgotten (their messages are stale anyway)."""
        self.bodies.forget_before(current_round - 1)
        self.forgiven = {i for i in self.forgiven if i[1] >= current_round - 1}

    @property
    def proven(self) -> bool:
        """Publishers are proven: a sender's key can be trusted to be its own, so it may be cut off."""
        return self.publishers.strict

    def count_invalid(self, routing_key: str, redelivered: bool) -> int | None:
        """A malformed message, or a repeat the broker did not redeliver, counts against the sender its key names
        where publishers are proven. Returns the sender when this count cuts it off (it is `blocked` from now on:
        the driver unbinds it and stops waiting for it), else None."""
        if not self.publishers.strict or redelivered:
            return None
        key = model_key_of(routing_key)
        if key is None or key.sender == SERVER or key.sender in self.blocked:
            return None
        self.invalid[key.sender] += 1
        if self.invalid[key.sender] < self.block_after:
            return None
        self.blocked.add(key.sender)
        return key.sender


MessageIdentity = tuple[int, int, str, int, int]  # sender, round, exchange, step, part


def identity_of(envelope: Envelope) -> MessageIdentity:
    """A message's identity: one honest body each."""
    return envelope.sender, envelope.round, envelope.exchange, envelope.step, envelope.part


@dataclass
class BodyLedger:
    """The checksum of the first body let in for each message identity (dfca.wire.codec: BLAKE3)."""

    first: dict[MessageIdentity, str] = field(default_factory=dict)

    def same_or_first(self, identity: MessageIdentity, digest: str) -> bool:
        """True for the first body of `identity` (recorded) or a copy of it; False for a different one."""
        return self.first.setdefault(identity, digest) == digest

    def forget_before(self, round_: int) -> None:
        self.first = {i: d for i, d in self.first.items() if i[1] >= round_}
