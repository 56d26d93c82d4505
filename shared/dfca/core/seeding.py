"""Farthest-first seeding of the k cluster models by max-flooding: robust DFCA's initialization.

Why. With random initial models the first assignment (eq. 4) is decided by which random model has
the lowest loss overall, not by the data: most clients pick the same model, some models are never
picked (they stay random and are never chosen again), and two distributions share a cluster. IFCA
recovers from part of this through its global average; on a sparse graph a client's copy of its
cluster is mostly its own training, so assignments lock in within a few rounds, and regions of the
graph settle on different meanings of the same index (docs/cluster_recovery.md).

What. A decentralized k-means++ (deterministic farthest-first, the loss as the distance) that
gives every client the same k models, each the local model of a client of a different
distribution, before any cluster model is trained:

0. Every client trains a local model phi_i: its copy of cluster 0, `dfca.seed_epochs` epochs of
   SGD on its own data (no communication).
1. Slot 0: every client's candidate is (u_i, i, phi_i), u_i a seeded uniform number.
   Slot s >= 1: (min_{j<s} F(seed_j, D_i), i, phi_i): how badly the seeds so far fit the client.
2. For `flood_rounds` rounds every client sends its current candidate to its neighbours and keeps
   the best one it has seen (higher score wins; on a tie the lower client id). After as many rounds
   as the graph's diameter every client holds the same candidate: the global farthest client.
3. seed_s := that candidate's model, at every client: theta_{i,s} <- seed_s.

The k slots take k * flood_rounds rounds (dfca.schedule), one message per neighbour per round, no
training. Lost or late messages only slow the flood; the max does not depend on arrival order.

Which copy of a candidate's model a host keeps. A slot-0 score is checked (every receiver recomputes the draw), its
model is not: a liar can relay the true top draw with a model of its own. So a copy of origin o's candidate that
client s sends ranks by how near s is to o in the graph (`RelayHops`): first-hand (s = o) ranks 1, a relay
dist(s, o) + 1, and a relay sent in a slot's round r before o's candidate can have reached s (r < dist(s, o)) is a
lie, refused. A host keeps, for each origin, the copy that came with the best rank, then from the most senders at
that rank, then from the lowest sender id (`OriginCopies`), and every hosted row that holds that origin holds that
copy: a host with one client next to the origin holds the origin's own model from the slot's first round on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dfca.models.batched import Params


def first_slot_scores(seed: int, clients: Sequence[int]) -> Tensor:
    """Slot 0's scores: one seeded uniform number per client, the same however clients are grouped."""
    return torch.tensor(
        [float(torch.rand(1, generator=torch.Generator().manual_seed(seed * 1_000_003 + 104_723 + c)))
         for c in clients],
        dtype=torch.float64,
    )


def fit_scores(losses: Tensor, slot: int) -> Tensor:
    """Slot s >= 1: each client's loss under the seed that fits it best so far, [M, k] -> [M]."""
    return losses[:, :slot].min(dim=1).values.to(torch.float64)


def refused_candidates(score: Tensor, origin: Tensor, slot: int, seed: int, num_clients: int) -> Tensor:
    """[S] bool: the arrived candidates no receiver may keep, whatever their model.

    A score must be finite and not negative, the origin a client of the run; in slot 0 the score is the
    origin's seeded draw, which every receiver recomputes (an inflated one is a lie, not a far client).
    Later slots' scores (a loss on the origin's data) cannot be checked by anyone else: their candidates
    are only checked to be models at all (`responds_to_input`)."""
    bad = ~torch.isfinite(score) | (score < 0) | (origin < 0) | (origin >= num_clients)
    if slot == 0 and bool((~bad).any()):
        ok = (~bad).nonzero().squeeze(1)
        drawn = first_slot_scores(seed, origin[ok].tolist()).to(score.device)
        bad[ok] = score[ok].to(torch.float64) != drawn
    return bad


def responds_to_input(logits: Tensor) -> Tensor:
    """[S] bool from logits [S, B, C]: the candidate's logits are finite and not the same for every input (as an
    all-zero model's are). A model whose output ignores its input cannot seed a cluster."""
    finite = torch.isfinite(logits).flatten(1).all(1)
    spread = (logits - logits[:, :1]).abs().flatten(1).amax(1)
    return finite & (spread > 1e-6)


def beats(score: Tensor, origin: Tensor, best_score: Tensor, best_origin: Tensor) -> Tensor:
    """Candidate (score, origin) beats (best_score, best_origin): higher score, then lower client id."""
    return (score > best_score) | ((score == best_score) & (origin < best_origin))


def best_arrivals(score: Tensor, origin: Tensor, delivered: Tensor) -> Tensor:
    """[M] the arrived candidate each receiver likes best (an index into S), or -1 when none arrived.

    score [S], origin [S]: the arrived candidates; delivered [M, S] bool: receiver i got candidate s.
    """
    m, s = delivered.shape
    masked = torch.where(delivered, score.unsqueeze(0).expand(m, s), torch.tensor(-torch.inf, dtype=score.dtype,
                                                                                   device=score.device))
    top = masked.max(dim=1, keepdim=True).values
    tied = delivered & (masked == top)
    lowest = torch.where(tied, origin.unsqueeze(0).expand(m, s), torch.iinfo(torch.long).max)
    best = lowest.min(dim=1).indices
    return torch.where(delivered.any(1), best, -1)


FIRST_HAND = 1  # the rank of a copy its origin sent itself
UNRANKED = 1 << 30  # the rank of a copy whose path is not known (restored from a checkpoint) or is too long


class RelayHops:
    """How far apart clients of a graph are, for `hops`: breadth-first from each origin asked about, as far as asked,
    remembered per origin (`graph` is the mapping it walks: a new graph needs a new RelayHops)."""

    def __init__(self, graph: Mapping[int, Sequence[int]]) -> None:
        self.graph = graph
        self._reach: dict[int, tuple[int, dict[int, int]]] = {}  # origin -> (how far walked, client -> distance)

    def distances(self, origin: int, limit: int) -> dict[int, int]:
        """Every client within `limit` hops of `origin` (and maybe some further), and how many hops away."""
        walked, found = self._reach.get(origin, (-1, {}))
        if walked < limit:
            found, frontier = {origin: 0}, [origin]
            for depth in range(1, limit + 1):
                frontier = [m for c in frontier for m in self.graph.get(c, ()) if m not in found
                            and found.setdefault(m, depth) == depth]
                if not frontier:
                    break
            self._reach[origin] = (limit, found)
        return found

    def hops(self, senders: Tensor, origins: Tensor, limit: int, wanted: Tensor | None = None) -> Tensor:
        """[S] long: the graph distance from each origin to its sender (0 where they are one), UNRANKED beyond
        `limit` hops: how many rounds an origin's candidate needs to reach the sender through relays. Where `wanted`
        [S] bool is given, only for those (0 for the others)."""
        hops = torch.zeros(senders.shape[0], dtype=torch.long)
        relayed = ((senders != origins) & (True if wanted is None else wanted)).nonzero().squeeze(1).tolist()
        sender_ids, origin_ids = senders.tolist(), origins.tolist()
        for s in relayed:
            d = self.distances(int(origin_ids[s]), limit).get(int(sender_ids[s]), UNRANKED)
            hops[s] = d if d <= limit else UNRANKED
        return hops.to(senders.device)


@dataclass
class _Copy:
    model: Params  # as received
    rank: int  # the best rank it came with
    senders: set[int] = field(default_factory=set)  # who sent it at that rank
    owned: bool = False  # the model is a copy of its own, not a view of the inbox it came in


class OriginCopies:
    """The copies of one origin's candidate that reached a host, told apart by their values, and the one it keeps
    (`kept`): the best rank, then the most senders at that rank, then the lowest sender id."""

    def __init__(self) -> None:
        self.copies: list[_Copy] = []

    def add(self, model: Params, rank: int, sender: int) -> None:
        copy = next((c for c in self.copies if all(torch.equal(c.model[n], v) for n, v in model.items())), None)
        if copy is None:
            copy = _Copy(model, rank)
            self.copies.append(copy)
        if rank < copy.rank:
            copy.rank, copy.senders = rank, set()
        if rank == copy.rank and rank < UNRANKED:
            copy.senders.add(sender)

    def kept(self) -> Params:
        def order(copy: _Copy) -> tuple[int, int, int]:
            return copy.rank, -len(copy.senders), min(copy.senders, default=1 << 62)
        return min(self.copies, key=order).model

    def own(self) -> None:
        """Copy the kept models out of the tensors they arrived in (an inbox's), which the driver reuses."""
        for copy in self.copies:
            if not copy.owned:
                copy.model, copy.owned = {n: v.clone() for n, v in copy.model.items()}, True


class SeedCandidates:
    """The candidate (score, origin) each hosted client holds, and where its model is: a hosted client's
    local model, or a model that arrived with a candidate. A driver hosting every client never needs
    the second: it carries origins alone, and models are read only when a slot closes.

    `wire` is what crossing the wire does to a model (a lossy payload's rounding, dfca.wire.codec.as_received; None:
    nothing): a client holding another client's candidate holds it as received, wherever its origin is hosted.
    The rounding is idempotent, so a copy relayed any number of times is that copy."""

    def __init__(self, local: Params, clients: Tensor, wire: Callable[[Params], Params] | None = None) -> None:
        self.local = local  # phi [M, ...]
        self.wire = wire
        self.clients = clients
        self.row = {int(c): r for r, c in enumerate(clients.tolist())}
        self.score = torch.zeros(clients.shape[0], dtype=torch.float64, device=clients.device)
        self.origin = clients.clone()
        self.slot = 0
        self.arrived: dict[int, OriginCopies] = {}  # origin -> its copies, for origins not hosted here
        self._models: Params | None = None  # models(), until the candidates change

    def open(self, slot: int, scores: Tensor) -> None:
        """A slot's first round: every client's candidate is itself."""
        self.slot, self.score, self.origin, self.arrived = slot, scores.to(self.score.device), self.clients.clone(), {}
        self._models = None

    def restore(self, score: Tensor, origin: Tensor, slot: int, candidates: Params) -> None:
        """From a checkpoint: the candidates and, for origins not hosted here, their models [M, ...]."""
        self.slot, self.score, self.origin = slot, score.to(self.score.device), origin.to(self.origin.device)
        self.arrived = {}
        for r, o in enumerate(self.origin.tolist()):
            if int(o) not in self.row and int(o) not in self.arrived:
                self.arrived[int(o)] = OriginCopies()
                self.arrived[int(o)].add({n: v[r].to(self.origin.device) for n, v in candidates.items()},
                                         UNRANKED, -1)
                self.arrived[int(o)].own()
        self._models = None

    def models(self) -> Params:
        """[M, ...]: the model of every hosted client's candidate (as received where it is another client's); built
        once per change of the candidates (a round sends them, checkpoints them and may install them). Callers
        must not change the tensors in place."""
        if self._models is None:
            self._models = self._build_models()
        return self._models

    def origin_models(self) -> Params:
        """[M, ...]: each row's candidate as its origin sent it (the origin's local model), for a driver that hosts
        every origin and rounds every message it delivers itself (the simulator's `as_received`). The rounding is
        idempotent, so receivers decode from these what they decode from `models()`, which rounds the relayed
        candidates before they are sent: this skips that copy and that second rounding every seeding round."""
        origins = self.origin.tolist()
        if not all(o in self.row for o in origins):
            raise ValueError("origin_models needs every candidate's origin hosted here")
        return self._stacked(origins)

    def _build_models(self) -> Params:
        return self._held(self.origin.tolist(), self.clients.tolist())

    def _stacked(self, origins: list[int]) -> Params:
        """[len(origins), ...]: the model this host keeps of each origin's candidate (`kept_model`), a new tensor."""
        if all(o in self.row for o in origins):
            rows = torch.tensor([self.row[o] for o in origins], device=self.origin.device)
            return {n: v.index_select(0, rows) for n, v in self.local.items()}
        chosen = [self.kept_model(o) for o in origins]
        return {n: torch.stack([c[n] for c in chosen]) for n in self.local}

    def _held(self, origins: list[int], own: list[int] | None = None) -> Params:
        """[len(origins), ...]: the model of each origin's candidate as a receiver holds it, a new tensor. A model
        hosted here (the origin's local model) is rounded by the wire, except in a row whose own it is (`own`: each
        row's client); a copy that arrived from another host is as it arrived: it is on the wire's grid already, and
        rounding it again gives the same values."""
        models = self._stacked(origins)
        rows = [r for r, o in enumerate(origins) if o in self.row and (own is None or o != own[r])]
        if self.wire is not None and rows:
            index = torch.tensor(rows, device=self.origin.device)
            received = self.wire({n: v.index_select(0, index) for n, v in models.items()})
            for n, v in models.items():
                v.index_copy_(0, index, received[n].to(v.dtype))
        return models

    def offer(self, delivered: Tensor, score: Tensor, origin: Tensor, models: Mapping[str, Tensor],
              check: Callable[[Tensor, Params], Tensor] | None = None, sender: Tensor | None = None,
              rank: Tensor | None = None) -> int:
        """Arrived candidates: each client keeps the best of its own and the ones delivered to it, and the host
        keeps one copy of each origin's model (`OriginCopies`) for all its rows.

        `sender` [S], `rank` [S] (`RelayHops.hops` + 1: FIRST_HAND for a copy its origin sent): who sent each copy and
        how near its origin (by default every copy is first-hand, from the sender of its index).
        `check(rows, candidate models [R, ...])` -> [R] bool: whether each row may keep the candidate it
        likes best (the copy its host keeps); a refused one is dropped for that row and its next best considered.
        Returns the number of (row, candidate) pairs refused."""
        delivered = delivered.clone()
        senders = (sender if sender is not None else torch.arange(score.shape[0])).tolist()
        ranks = (rank if rank is not None else torch.full((score.shape[0],), FIRST_HAND)).tolist()
        # the copies that may be kept: of candidates hosted elsewhere, as good as the held one of a row they reached
        at_least = ~beats(self.score.unsqueeze(1), self.origin.unsqueeze(1), score.unsqueeze(0), origin.unsqueeze(0))
        reached = (delivered & at_least).any(0).nonzero().squeeze(1).tolist()
        fresh = [a for a in reached if int(origin[a]) not in self.row]
        for a in fresh:
            self.arrived.setdefault(int(origin[a]), OriginCopies()).add({n: models[n][a] for n in self.local}, ranks[a],
                                                                        senders[a])
        if fresh:
            self._models = None  # a held origin's kept copy may have changed
        refused = 0
        while True:
            best = best_arrivals(score, origin, delivered)
            rows = (best >= 0).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            pick = best[rows]
            better = beats(score[pick], origin[pick], self.score[rows], self.origin[rows])
            rows, pick = rows[better], pick[better]
            if rows.numel() == 0:
                break
            if check is not None:
                ok = check(rows, self._held(origin[pick].tolist()))  # as the rows would hold them
                if not bool(ok.all()):
                    refused_origins = origin[pick[~ok]]
                    delivered[rows[~ok]] &= origin.unsqueeze(0) != refused_origins.unsqueeze(1)
                    refused += int((~ok).sum())
                    continue
            self.score[rows], self.origin[rows] = score[pick], origin[pick]
            self._models = None
            break
        held = set(self.origin.tolist())
        self.arrived = {o: copies for o, copies in self.arrived.items() if o in held}
        for copies in self.arrived.values():
            copies.own()
        return refused

    def kept_model(self, origin: int) -> Params:
        """The model of origin's candidate this host keeps: its local model where it is hosted here."""
        r = self.row.get(origin)
        return {n: v[r] for n, v in self.local.items()} if r is not None else self.arrived[origin].kept()

    def install(self, params: Params, slot: int) -> None:
        """After a slot's last round: each client's candidate becomes its model of cluster `slot`."""
        for n, v in self.models().items():
            params[n][:, slot] = v
