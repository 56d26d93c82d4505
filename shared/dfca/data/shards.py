"""Per-client tensors: what every driver hosts, images or feature vectors, on a device.

Clients of unequal size are padded: client i's train set is its first `train_count[i]` rows of x_train[i]
(the rest is padding, never trained on or counted), and likewise for test. Where every client is full the
counts are None. A federation whose true clusters are unknown (a folder without clusters.json) has
true_cluster -1 everywhere; `has_true_clusters` says so, and nothing reports ARI then.

Where padding every client to the largest would more than double the rows stored (BUCKET_ABOVE), the clients
are bucketed by size instead: `buckets` holds groups of clients of similar size (the largest at most
BUCKET_SPREAD times the smallest), each padded only to its own largest client, and the federation's own
x/y tensors hold no rows (width 0). `blocks()` gives the rows to compute on either way; `padded()` builds the
one padded tensor set where an algorithm needs it (feature vectors: small).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class FederatedData:
    """Per-client tensors; client i's train set is (x_train[i], y_train[i])."""

    x_train: torch.Tensor  # [N, n_train, C, H, W] float32 in [0, 1]
    y_train: torch.Tensor  # [N, n_train] int64
    x_test: torch.Tensor  # [N, n_test, C, H, W] float32 in [0, 1]
    y_test: torch.Tensor  # [N, n_test] int64
    true_cluster: torch.Tensor  # [N] int64: the client's distribution (for mixtures, the primary one)
    num_classes: int
    mixture: torch.Tensor | None = None  # [N, k] float32 realised train share of each distribution (mixture only)
    train_distribution: torch.Tensor | None = None  # [N, n_train] int64 distribution of every train sample
    test_distribution: torch.Tensor | None = None  # [N, n_test] int64 distribution of every test sample
    rotations: tuple[int, ...] = ()  # degrees of each distribution j
    train_count: torch.Tensor | None = None  # [N] int64 real train samples of each client (None: all n_train)
    test_count: torch.Tensor | None = None  # [N] int64 real test samples of each client (None: all n_test)
    client_names: tuple[str, ...] = ()  # a folder federation's client ids, in row order (empty: 0..N-1)
    buckets: tuple[SizeBucket, ...] = ()  # clients grouped by size, each group padded apart (empty: not bucketed)

    def __post_init__(self) -> None:
        n = self.x_train.shape[0]
        per_client = [
            self.y_train,
            self.x_test,
            self.y_test,
            self.true_cluster,
            self.mixture,
            self.train_distribution,
            self.test_distribution,
            self.train_count,
            self.test_count,
        ]
        if self.client_names and len(self.client_names) != n:
            raise ValueError("FederatedData: client_names must name every client")
        if any(t is not None and t.shape[0] != n for t in per_client):
            raise ValueError("FederatedData: every per-client tensor must have the same first dimension N")

    @property
    def is_bucketed(self) -> bool:
        """Whether the rows live in `buckets` (padded per group of similar size) rather than in x/y."""
        return bool(self.buckets)

    @property
    def padding_overhead(self) -> float:
        """Rows stored (train and test, padding included) per real row: 1.0 where no client is padded."""
        parts = [d for _, d in self.blocks()]
        stored = sum(d.y_train.numel() + d.y_test.numel() for d in parts)
        real = int(self.train_sizes.sum()) + int(self.test_sizes.sum())
        return stored / max(1, real)

    def blocks(self) -> list[tuple[torch.Tensor | None, FederatedData]]:
        """The rows to compute on: (None, self) where not bucketed, else each bucket's (client rows [Nb], shards)."""
        if not self.buckets:
            return [(None, self)]
        return [(b.rows, b.data) for b in self.buckets]

    def client_shards(self, client: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Client `client`'s own (x, y) train and test sets, without padding (views)."""
        for rows, d in self.blocks():
            found = [client] if rows is None else (rows == client).nonzero().flatten().tolist()
            if not found:
                continue
            r = found[0]
            n, m = int(d.train_sizes[r]), int(d.test_sizes[r])
            return (d.x_train[r, :n], d.y_train[r, :n]), (d.x_test[r, :m], d.y_test[r, :m])
        raise IndexError(f"FederatedData: no client {client}")

    def padded(self) -> FederatedData:
        """The same federation with every client padded to the largest in one tensor set (itself where it is)."""
        if not self.buckets:
            return self
        n = self.num_clients
        train, test = zip(*(self.client_shards(c) for c in range(n)), strict=True)
        x_train, _ = padded([x for x, _ in train])
        y_train, _ = padded([y for _, y in train])
        x_test, _ = padded([x for x, _ in test])
        y_test, _ = padded([y for _, y in test])
        return FederatedData(
            x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, true_cluster=self.true_cluster,
            num_classes=self.num_classes, rotations=self.rotations, train_count=self.train_count,
            test_count=self.test_count, client_names=self.client_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """(C, H, W) of an image, or (d,) of a feature vector."""
        return tuple(int(s) for s in self.x_train.shape[2:])

    @property
    def num_clients(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def has_true_clusters(self) -> bool:
        """Whether true_cluster is known (ARI and per-cluster metrics need it)."""
        return bool((self.true_cluster >= 0).all())

    @property
    def is_ragged(self) -> bool:
        """Whether some client holds fewer rows than the padded tensors have."""
        return self.train_count is not None or self.test_count is not None

    @property
    def train_sizes(self) -> torch.Tensor:
        """[N] int64: each client's real train sample count (n_i of the papers)."""
        return sizes(self.train_count, self.y_train)

    @property
    def test_sizes(self) -> torch.Tensor:
        """[N] int64: each client's real test sample count."""
        return sizes(self.test_count, self.y_test)

    @property
    def train_mask(self) -> torch.Tensor | None:
        """[N, n_train] bool: True at a client's real train samples; None when every client is full."""
        return rows_mask(self.train_count, self.y_train)

    @property
    def test_mask(self) -> torch.Tensor | None:
        """[N, n_test] bool: True at a client's real test samples; None when every client is full."""
        return rows_mask(self.test_count, self.y_test)

    def name_of(self, client: int) -> str:
        """Client `client`'s id: its folder name, or its index."""
        return self.client_names[client] if self.client_names else str(client)

    def subset(self, clients: Sequence[int]) -> FederatedData:
        """The same data restricted to `clients` (in the given order); a ragged federation's part stays counted."""
        chosen = list(clients)
        if self.buckets:
            names = tuple(self.client_names[i] for i in chosen) if self.client_names else ()
            shards = [self.client_shards(c) for c in chosen]
            index = torch.as_tensor(chosen, dtype=torch.long, device=self.true_cluster.device)
            return from_clients([tr for tr, _ in shards], [te for _, te in shards], self.true_cluster[index],
                                self.num_classes, names, counted=True)
        index = torch.as_tensor(chosen, dtype=torch.long, device=self.x_train.device)
        names = tuple(self.client_names[i] for i in chosen) if self.client_names else ()
        return self._map(lambda t: t[index], names)

    def to(self, device: torch.device | str) -> FederatedData:
        """The same data on `device` (itself when it is there already)."""
        if self.x_train.device == torch.device(device):
            return self
        moved = self._map(lambda t: t.to(device), self.client_names)
        moved.buckets = tuple(SizeBucket(b.rows.to(device), b.data.to(device)) for b in self.buckets)
        return moved

    def _map(self, f: Callable[[torch.Tensor], torch.Tensor], client_names: tuple[str, ...]) -> FederatedData:
        def each(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else f(t)

        return FederatedData(
            x_train=f(self.x_train),
            y_train=f(self.y_train),
            x_test=f(self.x_test),
            y_test=f(self.y_test),
            true_cluster=f(self.true_cluster),
            num_classes=self.num_classes,
            mixture=each(self.mixture),
            train_distribution=each(self.train_distribution),
            test_distribution=each(self.test_distribution),
            rotations=self.rotations,
            train_count=each(self.train_count),
            test_count=each(self.test_count),
            client_names=client_names,
        )


def sizes(count: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
    if count is not None:
        return count
    return torch.full((labels.shape[0],), labels.shape[1], dtype=torch.long, device=labels.device)


def rows_mask(count: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor | None:
    if count is None:
        return None
    return torch.arange(labels.shape[1], device=labels.device).unsqueeze(0) < count.unsqueeze(1)


@dataclass
class SizeBucket:
    """Clients of similar size, padded together: rows [Nb] are their positions in the federation (ascending size)."""

    rows: torch.Tensor
    data: FederatedData


BUCKET_ABOVE = 2.0  # padding every client to the largest stores more than this many rows per real row: bucket
BUCKET_SPREAD = 1.5  # within a bucket, the largest client holds at most this many times the smallest's samples


def from_clients(
    train: Sequence[tuple[torch.Tensor, torch.Tensor]],
    test: Sequence[tuple[torch.Tensor, torch.Tensor]],
    true_cluster: torch.Tensor,
    num_classes: int,
    client_names: Sequence[str] = (),
    counted: bool = False,
) -> FederatedData:
    """A federation from each client's own (x, y) train and test sets, of any sizes: padded and counted; bucketed
    by size where one padding would more than double the rows (BUCKET_ABOVE). `counted`: keep the counts even
    where every client is full (a part of a ragged federation stays ragged)."""
    sizes_ = [len(y) for _, y in train]
    if len(train) > 1 and len(train) * max(sizes_) > BUCKET_ABOVE * sum(sizes_):
        return bucketed(train, test, true_cluster, num_classes, tuple(client_names))
    x_train, train_count = padded([x for x, _ in train], counted)
    y_train, _ = padded([y for _, y in train])
    x_test, test_count = padded([x for x, _ in test], counted)
    y_test, _ = padded([y for _, y in test])
    return FederatedData(
        x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, true_cluster=true_cluster,
        num_classes=num_classes, train_count=train_count, test_count=test_count, client_names=tuple(client_names),
    )


def size_groups(sizes_: Sequence[int]) -> list[list[int]]:
    """Client indices grouped by train size, ascending: a group's largest holds at most BUCKET_SPREAD x its smallest."""
    groups: list[list[int]] = []
    for i in sorted(range(len(sizes_)), key=lambda i: (sizes_[i], i)):
        if groups and sizes_[i] <= BUCKET_SPREAD * max(1, sizes_[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def bucketed(
    train: Sequence[tuple[torch.Tensor, torch.Tensor]],
    test: Sequence[tuple[torch.Tensor, torch.Tensor]],
    true_cluster: torch.Tensor,
    num_classes: int,
    client_names: tuple[str, ...],
) -> FederatedData:
    """The federation with its clients in SizeBuckets; its own x/y tensors hold no rows."""
    sizes_ = [len(y) for _, y in train]
    buckets = []
    for group in size_groups(sizes_):
        index = torch.as_tensor(group, dtype=torch.long, device=true_cluster.device)
        part = from_clients([train[i] for i in group], [test[i] for i in group], true_cluster[index], num_classes,
                            counted=True)
        buckets.append(SizeBucket(index, part))
    x, y = train[0]
    xt, yt = test[0]
    n = len(train)
    return FederatedData(
        x_train=x.new_zeros((n, 0, *x.shape[1:])), y_train=y.new_zeros((n, 0)),
        x_test=xt.new_zeros((n, 0, *xt.shape[1:])), y_test=yt.new_zeros((n, 0)), true_cluster=true_cluster,
        num_classes=num_classes, train_count=torch.tensor(sizes_, dtype=torch.long, device=y.device),
        test_count=torch.tensor([len(y) for _, y in test], dtype=torch.long, device=y.device),
        client_names=client_names, buckets=tuple(buckets),
    )


def padded(parts: Sequence[torch.Tensor], counted: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, max n, ...] with zeros after each part's rows, and the row counts (None when all are equal, unless
    `counted`)."""
    counts = torch.tensor([len(p) for p in parts], dtype=torch.long)
    longest = int(counts.max())
    out = parts[0].new_zeros((len(parts), longest, *parts[0].shape[1:]))
    for i, part in enumerate(parts):
        out[i, : len(part)] = part
    return out, None if bool((counts == longest).all()) and not counted else counts.to(out.device)
