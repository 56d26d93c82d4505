"""Forged messages: what a compromised worker can publish under its own clients' keys (the seed and consensus hijacks).

A compromised worker holds its own broker credentials, so the broker delivers whatever it publishes under its
own clients' keys: well-formed lies. `Forger` wraps the honest algorithm of such a worker and rewrites what its
clients send in robust DFCA's two agreement steps (algorithms.dfca):

Seeding (`seed`, core.seeding): the max-flood keeps the highest score, so a liar claims one.
- `inflate` (the seed hijack): the sender as origin with an all-zero model and a score of 1e300 (+inf,
  which the wire refuses as non-finite: this is the largest lie it lets through);
- `relay`: slot 0's scores are seeded draws every receiver recomputes, so the liar claims the origin with the
  highest draw and its true draw, with a model of its own in place of that client's (a relay swapping the
  model behind an honest origin); in later slots (whose scores are losses on the origin's own data, which no
  one else can check) a finite score of 1e300, with the same model. The model is `garbage`: random weights
  at an honest model's scale;
- `duplicate`: as `relay`, but in later slots the model is the liar's copy of the installed seed 0, so that
  two clusters would start from one model.

Consensus (`gossip`, core.consensus): ratio consensus mixes (num, den) pairs; a liar sends
- `inflate`: den 10^6 and num 0 (a huge weight on the zero model);
- `zeros`: den 1 and num 0 (the zero model at an honest weight);
- `flip`: den 1, its estimate num/den replaced by -3 times its honest estimate;
- `reverse` (made for the screen, core.screened_gossip): an honest-looking weight (1 on the cluster it trained, 0 on
  the others) on last round's model of that cluster moved 2.5 times its own training step backwards: close to
  what receivers agreed on, not much worse on their data, and against the direction training goes.

The lean schedule's one-hop merges (`models`) carry plain models, no weight; a liar sends in place of its trained
model the zero model (`inflate`, `zeros`), -3 times its model (`flip`) or, for `reverse`, last round's model moved
2.5 training steps backwards.

What the honest clients make of it is measured by benchmarks/byzantine.py and tests/test_byzantine.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from dfca.algorithms.base import Algorithm, Exchange, Outbox
from dfca.core.ratio import MIN_WEIGHT, trailing
from dfca.core.seeding import first_slot_scores

SeedAttack = Literal["none", "inflate", "relay", "duplicate"]
GossipAttack = Literal["none", "inflate", "zeros", "flip", "reverse"]
SEED_ATTACKS: tuple[SeedAttack, ...] = ("none", "inflate", "relay", "duplicate")
GOSSIP_ATTACKS: tuple[GossipAttack, ...] = ("none", "inflate", "zeros", "flip", "reverse")
LIE = 1e300  # a finite score no honest loss reaches


@dataclass(frozen=True)
class Attack:
    seed: SeedAttack = "none"
    gossip: GossipAttack = "none"

    @property
    def label(self) -> str:
        return f"seed={self.seed},gossip={self.gossip}"

    @classmethod
    def parse(cls, text: str) -> Attack:
        """'seed=relay,gossip=zeros' (either part may be left out) -> Attack; ValueError naming what is wrong."""
        parts: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = item.partition("=")
            choices = {"seed": SEED_ATTACKS, "gossip": GOSSIP_ATTACKS}.get(key.strip())
            if choices is None or value.strip() not in choices:
                raise ValueError(f"DFCA_FORGE: {item!r} is not seed=<{'|'.join(SEED_ATTACKS)}> or "
                                 f"gossip=<{'|'.join(GOSSIP_ATTACKS)}>")
            parts[key.strip()] = value.strip()
        return cls(**parts)  # type: ignore[arg-type]


def top_draw(seed: int, num_clients: int) -> tuple[int, float]:
    """The client with the highest slot-0 draw, and the draw: what a `relay` liar claims."""
    draws = first_slot_scores(seed, range(num_clients))
    best = int(draws.argmax())
    return best, float(draws[best])


def garbage_like(params: Mapping[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
    """Random weights with each tensor's own scale (an honest model's standard deviation): plausible, useless."""
    return {n: torch.randn(v.shape, generator=generator, dtype=v.dtype).to(v.device) * v.float().std().clamp_min(1e-3)
            for n, v in params.items()}


def forged_seed(attack: SeedAttack, honest: Mapping[str, Tensor], names: list[str], slot: int, seed: int,
                num_clients: int, senders: Tensor, seed_zero: Mapping[str, Tensor],
                generator: torch.Generator) -> dict[str, Tensor]:
    """The seed messages [S, ...] of `attack` in place of the honest ones."""
    out = {n: honest[n].clone() for n in [*names, "score", "origin"]}
    models = {n: out[n] for n in names}
    if attack == "inflate":
        out["score"].fill_(LIE)
        out["origin"].copy_(senders)
        for v in models.values():
            v.zero_()
        return out
    if slot == 0:
        origin, draw = top_draw(seed, num_clients)
        out["origin"].fill_(origin)
        out["score"].fill_(draw)
    else:
        out["origin"].copy_(senders)
        out["score"].fill_(LIE)
    if attack == "duplicate" and slot > 0:
        fake = {n: seed_zero[n].unsqueeze(0).expand_as(v) for n, v in models.items()}
    else:
        fake = garbage_like({n: v[:1] for n, v in models.items()}, generator)
        fake = {n: t.expand_as(models[n]) for n, t in fake.items()}
    for n, v in models.items():
        v.copy_(fake[n])
    return out


def forged_gossip(attack: GossipAttack, honest: Mapping[str, Tensor], anchor: Mapping[str, Tensor],
                  trained: Mapping[str, Tensor], assigned: Tensor) -> dict[str, Tensor]:
    """The consensus pairs [S, k, ...] of `attack` in place of the honest (num, den); `anchor`, `trained` [S, k, ...]:
    the senders' models before and after this round's training, `assigned` [S]: the cluster each trained."""
    den = honest["den"]
    if attack == "reverse":
        weight = torch.nn.functional.one_hot(assigned, den.shape[1]).to(den.dtype)
        step = {n: trained[n] - anchor[n] for n in anchor}
        moved = {n: anchor[n] - 2.5 * step[n][torch.arange(assigned.shape[0]), assigned].unsqueeze(1) for n in anchor}
        return {**{f"num.{n}": v * trailing(weight, v) for n, v in moved.items()}, "den": weight}
    if attack == "inflate":
        return {**{n: torch.zeros_like(v) for n, v in honest.items() if n != "den"}, "den": torch.full_like(den, 1e6)}
    if attack == "zeros":
        return {**{n: torch.zeros_like(v) for n, v in honest.items() if n != "den"}, "den": torch.ones_like(den)}
    out: dict[str, Tensor] = {"den": torch.ones_like(den)}
    for n, v in honest.items():
        if n == "den":
            continue
        out[n] = -3.0 * (v / trailing(den.clamp_min(MIN_WEIGHT), v))  # -3 times its estimate, at weight 1
    return out


def forged_models(attack: GossipAttack, honest: Mapping[str, Tensor], anchor: Mapping[str, Tensor],
                  trained: Mapping[str, Tensor], part: Tensor) -> dict[str, Tensor]:
    """The one-hop merge's models [S, ...] of `attack` in place of the honest ones (cluster part[s] each); `anchor`,
    `trained` [S, k, ...]: the senders' models before and after this round's training."""
    rows = torch.arange(part.shape[0])
    out = dict(honest)
    for n in anchor:
        if attack == "reverse":
            before = anchor[n][rows, part]
            out[n] = before - 2.5 * (trained[n][rows, part] - before)
        elif attack == "flip":
            out[n] = -3.0 * honest[n]
        else:  # inflate, zeros: a merge carries no weight to inflate
            out[n] = torch.zeros_like(honest[n])
    return out


class Forger:
    """A compromised host: its algorithm runs honestly (it trains, receives, reports), but what its clients send
    in the exchanges `attack` names is forged. Everything else is the wrapped algorithm's."""

    def __init__(self, inner: Algorithm, attack: Attack, seed: int = 0) -> None:
        self.inner, self.attack = inner, attack
        self.round = -1
        self.generator = torch.Generator().manual_seed(seed)
        self.forged = 0  # messages forged

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin_round(self, t: int) -> None:
        self.round = t
        params = getattr(self.inner, "params", None)
        self.anchor = {n: v.clone() for n, v in params.items()} if isinstance(params, dict) else {}
        self.inner.begin_round(t)
        self.trained = {n: v.clone() for n, v in self.inner.params.items()} if self.anchor else {}  # type: ignore

    def send(self, ex: Exchange) -> Outbox:
        out = self.inner.send(ex)
        cfg = self.inner.ctx.cfg
        senders = self.inner.ctx.rows.index_select(0, out.row)
        if ex.name == "seed" and self.attack.seed != "none":
            step = self.inner.schedule.seeding(self.round)
            assert step is not None
            names = [n for n in out.tensors if n not in ("score", "origin")]
            seed_zero = {n: v[0, 0] for n, v in self.inner.params.items()}  # type: ignore[attr-defined]
            tensors = forged_seed(self.attack.seed, out.tensors, names, step.slot, cfg.seed, cfg.data.clients,
                                  senders, seed_zero, self.generator)
        elif ex.name == "gossip" and self.attack.gossip != "none":
            rows = out.row
            tensors = forged_gossip(self.attack.gossip, out.tensors,
                                    {n: v.index_select(0, rows) for n, v in self.anchor.items()},
                                    {n: v.index_select(0, rows) for n, v in self.trained.items()},
                                    self.inner.assigned.index_select(0, rows))  # type: ignore[attr-defined]
        elif ex.name == "models" and self.attack.gossip != "none" and self.anchor:
            rows = out.row
            tensors = forged_models(self.attack.gossip, out.tensors,
                                    {n: v.index_select(0, rows) for n, v in self.anchor.items()},
                                    {n: v.index_select(0, rows) for n, v in self.trained.items()}, out.part)
        else:
            return out
        self.forged += int(out.row.numel())
        return Outbox(out.row, out.part, tensors, out.lengths)
