"""Sampling cluster assignments under a Dirichlet process mixture (DPMM-CFL, Sec. 3): pure math, no config.

Observations are client representations x_i in R^d (rows of X). The model is the infinite Gaussian
mixture with Normal-Normal conjugacy:

    c ~ CRP(alpha)                                      prior (11)
    mu_k ~ G0 = N(0, s0 I)                              base measure (s0 = sigma_0^2)
    x_i | c_i, mu ~ N(mu_{c_i}, s I)                    likelihood (4), Sigma = s I

so mu_k integrates out and the posterior over partitions is p(c | X) ~ p(c | alpha) prod_k p(W_k | G0),
eq. (12)-(13). With an isotropic Sigma the marginal (13) factorises over dimensions; for a cluster of n
points with sum S and sum of squared norms Q:

    log p(W | G0) = -n d/2 log(2 pi s) - d/2 log(1 + n s0/s) - (Q - s0 |S|^2 / (s + n s0)) / (2 s)

Two samplers leave that posterior invariant: collapsed Gibbs (Neal 2000, Algorithm 3), one client at a
time, and split-merge with restricted Gibbs proposals from a random launch state (Jain and Neal 2004,
Sec. 3.3.2), accepted by Metropolis-Hastings (14). `tests/test_dpmm.py` checks both against the exact
posterior, enumerated over every partition of a few points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

Array = np.ndarray


def crp_log_prior(sizes: list[int], alpha: float) -> float:
    """log p(c | alpha), eq. (11): Gamma(alpha) / Gamma(alpha + M) * alpha^K * prod_k Gamma(m_k)."""
    m = sum(sizes)
    return (math.lgamma(alpha) - math.lgamma(alpha + m) + len(sizes) * math.log(alpha)
            + sum(math.lgamma(s) for s in sizes))


@dataclass(frozen=True)
class NormalNormal:
    """The conjugate marginal likelihood (13) with Sigma = s I and G0 = N(0, s0 I)."""

    s: float  # likelihood variance
    s0: float  # base-measure variance (sigma_0^2)

    def log_marginal(self, n: int, total: Array, squares: float) -> float:
        """log p(W | G0) of a cluster of n points with sum `total` [d] and sum of squared norms `squares`."""
        if n == 0:
            return 0.0
        d, s, s0 = total.shape[0], self.s, self.s0
        fit = squares - s0 * float(total @ total) / (s + n * s0)
        return -0.5 * n * d * math.log(2 * math.pi * s) - 0.5 * d * math.log1p(n * s0 / s) - fit / (2 * s)

    def log_joint(self, x: Array, labels: list[int], alpha: float) -> float:
        """log p(c | alpha) + sum_k log p(W_k | G0): the unnormalised log posterior (12) of `labels`."""
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(labels):
            groups.setdefault(c, []).append(i)
        out = crp_log_prior([len(g) for g in groups.values()], alpha)
        for rows in groups.values():
            xs = x[rows]
            out += self.log_marginal(len(rows), xs.sum(0), float((xs * xs).sum()))
        return out


@dataclass
class Component:
    """Sufficient statistics of one cluster: count, sum, sum of squared norms."""

    n: int
    total: Array
    squares: float

    @classmethod
    def of(cls, x: Array, rows: list[int]) -> Component:
        xs = x[rows] if rows else x[:0]
        return cls(len(rows), xs.sum(0), float((xs * xs).sum()))

    def add(self, xi: Array, qi: float, sign: int = 1) -> None:
        self.n += sign
        self.total = self.total + sign * xi
        self.squares += sign * qi


def log_predictive(lik: NormalNormal, comp: Component, xi: Array, qi: float) -> float:
    """log p(x_i | the component's points): a difference of two marginals (13)."""
    grown = lik.log_marginal(comp.n + 1, comp.total + xi, comp.squares + qi)
    return grown - lik.log_marginal(comp.n, comp.total, comp.squares)


@dataclass
class ChainStats:
    """Proposals made and accepted in one call of the sampler."""

    splits_proposed: int = 0
    splits_accepted: int = 0
    merges_proposed: int = 0
    merges_accepted: int = 0
    gibbs_moves: int = 0  # clients whose cluster a Gibbs scan changed

    @property
    def split_rate(self) -> float:
        return self.splits_accepted / self.splits_proposed if self.splits_proposed else 0.0

    @property
    def merge_rate(self) -> float:
        return self.merges_accepted / self.merges_proposed if self.merges_proposed else 0.0


@dataclass
class DPMMSampler:
    """Markov chain over partitions of the rows of x that leaves the posterior (12) invariant."""

    x: Array  # [M, d] float64
    alpha: float
    lik: NormalNormal
    rng: np.random.Generator
    launch_scans: int = 5  # t: intermediate restricted Gibbs scans that build the launch state
    stats: ChainStats = field(default_factory=ChainStats)

    def __post_init__(self) -> None:
        self.q = (self.x * self.x).sum(1).tolist()

    # -- randomness from the one generator, so a run is reproducible ------------------------------------------
    def _uniform(self) -> float:
        return float(self.rng.random())

    def _pick(self, logits: list[float]) -> int:
        w = np.exp(np.asarray(logits) - max(logits))
        return int(self.rng.choice(len(w), p=w / w.sum()))

    # -- collapsed Gibbs (Neal 2000, Algorithm 3) -----------------------------------------------------------
    def gibbs_scan(self, labels: list[int]) -> list[int]:
        """Resample every c_i given the others: existing cluster k with m_{-i,k} p(x_i | W_k^{-i}), a new one
        with alpha p(x_i | G0)."""
        labels = list(labels)
        comps = {c: Component.of(self.x, [i for i, ci in enumerate(labels) if ci == c]) for c in set(labels)}
        order = self.rng.permutation(len(labels)).tolist()
        for i in order:
            xi, qi, old = self.x[i], self.q[i], labels[i]
            comps[old].add(xi, qi, -1)
            if comps[old].n == 0:
                del comps[old]
            keys = list(comps)
            logits = [math.log(comps[c].n) + log_predictive(self.lik, comps[c], xi, qi) for c in keys]
            empty = Component(0, np.zeros_like(xi), 0.0)
            logits.append(math.log(self.alpha) + log_predictive(self.lik, empty, xi, qi))
            choice = self._pick(logits)
            new = keys[choice] if choice < len(keys) else max(labels) + 1  # an unused label
            if new not in comps:
                comps[new] = Component(0, np.zeros_like(xi), 0.0)
            comps[new].add(xi, qi)
            self.stats.gibbs_moves += int(new != old)
            labels[i] = new
        return labels

    # -- split-merge (Jain and Neal 2004, Sec. 3.3.2) ------------------------------------------------------
    def _restricted_scan(self, side: dict[int, int], comps: list[Component], rows: list[int],
                         target: dict[int, int] | None) -> float:
        """One restricted Gibbs scan over `rows` between the two components (side 0: i's, side 1: j's).

        Moves each row to a side drawn from its conditional, or, with `target`, to its target side. Returns the
        log probability of the transition it made.
        """
        log_q = 0.0
        for k in rows:
            xk, qk = self.x[k], self.q[k]
            comps[side[k]].add(xk, qk, -1)
            a, b = (math.log(c.n) + log_predictive(self.lik, c, xk, qk) for c in comps)  # n >= 1: i, j stay
            top = max(a, b)
            norm = top + math.log(math.exp(a - top) + math.exp(b - top))
            new = (0 if self._uniform() < math.exp(a - norm) else 1) if target is None else target[k]
            log_q += (a if new == 0 else b) - norm
            side[k] = new
            comps[new].add(xk, qk)
        return log_q

    def split_merge(self, labels: list[int]) -> list[int]:
        """One split-merge proposal, accepted with probability (14)."""
        m = len(labels)
        if m < 2:
            return labels
        pair = self.rng.choice(m, 2, replace=False).tolist()
        i, j = pair
        ci, cj = labels[i], labels[j]
        rows = [k for k in range(m) if k not in (i, j) and labels[k] in (ci, cj)]
        # the launch state: every other member of the two clusters on a uniformly random side, then t scans
        side = {i: 0, j: 1}
        for k in rows:
            side[k] = 0 if self._uniform() < 0.5 else 1
        comps = [Component.of(self.x, [k for k in side if side[k] == s]) for s in (0, 1)]
        for _ in range(self.launch_scans):
            self._restricted_scan(side, comps, rows, None)
        members = [i, j, *rows]
        whole = Component.of(self.x, members)
        lik, alpha = self.lik, self.alpha
        if ci == cj:  # split: a final restricted scan proposes it
            self.stats.splits_proposed += 1
            log_q = self._restricted_scan(side, comps, rows, None)
            n0, n1 = comps[0].n, comps[1].n
            log_a = (math.log(alpha) + math.lgamma(n0) + math.lgamma(n1) - math.lgamma(n0 + n1)
                     + lik.log_marginal(n0, comps[0].total, comps[0].squares)
                     + lik.log_marginal(n1, comps[1].total, comps[1].squares)
                     - lik.log_marginal(whole.n, whole.total, whole.squares) - log_q)
            if math.log(max(self._uniform(), 1e-300)) < log_a:
                self.stats.splits_accepted += 1
                fresh = max(labels) + 1
                return [fresh if k in side and side[k] == 0 else c for k, c in enumerate(labels)]
            return labels
        # merge: q(c | c_merge) is the final scan's probability of restoring the present split
        self.stats.merges_proposed += 1
        original = {k: 0 if labels[k] == ci else 1 for k in rows}
        log_q = self._restricted_scan(side, comps, rows, original)
        now = [Component.of(self.x, [k for k in members if labels[k] == c]) for c in (ci, cj)]
        log_a = (-math.log(alpha) + math.lgamma(whole.n) - math.lgamma(now[0].n) - math.lgamma(now[1].n)
                 + lik.log_marginal(whole.n, whole.total, whole.squares)
                 - lik.log_marginal(now[0].n, now[0].total, now[0].squares)
                 - lik.log_marginal(now[1].n, now[1].total, now[1].squares) + log_q)
        if math.log(max(self._uniform(), 1e-300)) < log_a:
            self.stats.merges_accepted += 1
            return [cj if c == ci else c for c in labels]
        return labels


def canonical(labels: list[int]) -> list[int]:
    """Relabel clusters 0..K-1 in order of their first member."""
    names: dict[int, int] = {}
    return [names.setdefault(c, len(names)) for c in labels]


def nearest_neighbour_variance(x: Array) -> float:
    """A plug-in likelihood variance s: the median over rows of the squared distance to the nearest other row,
    divided by 2d (E|x_i - x_j|^2 = 2 d s for two points of one cluster)."""
    if x.shape[0] < 2:
        return 1.0
    sq = (x * x).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0)
    np.fill_diagonal(d2, np.inf)
    return max(float(np.median(d2.min(1))) / (2 * x.shape[1]), 1e-12)


def pooled_variance(x: Array, labels: list[int]) -> float:
    """A plug-in likelihood variance s: the pooled within-cluster variance per dimension under `labels`."""
    lab = np.asarray(labels)
    clusters = np.unique(lab)
    resid = sum(float(((x[lab == c] - x[lab == c].mean(0)) ** 2).sum()) for c in clusters)
    return max(resid / (max(x.shape[0] - len(clusters), 1) * x.shape[1]), 1e-12)
