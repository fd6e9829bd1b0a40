"""Token sources and the per-rank loader.

Every batch is a pure function of ``(seed, split, global batch index)``, so the data position
is one integer: a resume that restores it continues the exact stream, and one that does not
(``resume_data_replay``) replays batches whose fingerprints repeat. Ranks interleave global
batch indices like ``DistributedSampler`` (rank r of W reads indices r, r+W, r+2W, ...), so
each rank sees different data and together they see each index once.

* :class:`MarkovSource` — a seeded first-order Markov chain over the vocabulary. Its entropy
  rate is the best loss any model can reach (``entropy_floor``), and an untrained model starts
  near ``ln(vocab_size)``, so a test can check that training goes from one toward the other.
* :class:`TokenFileSource` — nanoGPT-style ``uint16`` token files, random windows per batch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

__all__ = ["Loader", "MarkovSource", "TokenFileSource", "TokenSource", "one_document_batches"]

TRAIN, VAL = 0, 1


def _generator(seed: int, split: int, index: int) -> torch.Generator:
    """A generator private to one batch: independent of the global RNG and of other batches."""
    digest = hashlib.blake2b(f"{seed}/{split}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class TokenSource(Protocol):
    vocab_size: int
    entropy_floor: float | None

    def batch(self, index: int, split: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class MarkovSource:
    """A random first-order Markov chain: each token has ``branching`` successors.

    Successor probabilities are Dirichlet(1) draws, fixed by ``seed``. Sequences start from the
    stationary distribution, so every target is predicted from its predecessor at the chain's
    entropy rate: ``entropy_floor = sum_s pi(s) H(P[s, :])`` nats.
    """

    def __init__(self, vocab_size: int, seed: int, branching: int = 4) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        V, k = vocab_size, branching
        successors = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(V)])
        weights = -torch.log(torch.rand(V, k, generator=g, dtype=torch.float64))  # Exp(1) → Dirichlet(1)
        P = torch.zeros(V, V, dtype=torch.float64)
        P.scatter_(1, successors, weights / weights.sum(1, keepdim=True))
        pi = torch.full((V,), 1.0 / V, dtype=torch.float64)
        for _ in range(2000):  # power iteration to the stationary distribution
            pi = pi @ P
        pi = pi / pi.sum()
        row_entropy = -(P * torch.log(torch.where(P > 0, P, 1.0))).sum(1)
        self.entropy_floor = float((pi * row_entropy).sum())
        self.stationary = pi
        self._cdf = torch.cumsum(P, 1)
        self._cdf[:, -1] = 1.0  # guard against rounding: every uniform draw lands in a bucket
        self._pi_cdf = torch.cumsum(pi, 0)
        self._pi_cdf[-1] = 1.0

    def batch(self, index: int, split: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, split, index)
        u = torch.rand(seq_len + 1, batch_size, 1, generator=g, dtype=torch.float64)  # u[t]: contiguous
        seq = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.searchsorted(self._pi_cdf, u[0, :, 0])
        for t in range(1, seq_len + 1):
            cdf = self._cdf[seq[:, t - 1]]
            seq[:, t] = torch.searchsorted(cdf, u[t]).squeeze(1)
        seq.clamp_(max=self.vocab_size - 1)
        return seq[:, :-1], seq[:, 1:]


class TokenFileSource:
    """nanoGPT-style data: a flat ``uint16`` array of token ids on disk (``np.memmap``).

    Batches are random windows; validation reads ``val_path``, or the last 10% of the training
    file when there is none (training then uses the first 90%). Token ids must be below
    ``vocab_size`` (not checked: that would read the whole file).
    """

    entropy_floor = None

    def __init__(self, path: str | Path, vocab_size: int, seed: int, val_path: str | Path | None = None) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        data = np.memmap(path, dtype=np.uint16, mode="r")
        if val_path is not None:
            self._splits = (data, np.memmap(val_path, dtype=np.uint16, mode="r"))
        else:
            cut = int(len(data) * 0.9)
            self._splits = (data[:cut], data[cut:])

    def batch(self, index: int, split: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._splits[split]
        if len(data) <= seq_len + 1:
            raise ValueError(f"data: split {split} has {len(data)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        g = _generator(self.seed, split, index)
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=g).tolist()
        seq = torch.from_numpy(np.stack([data[s : s + seq_len + 1].astype(np.int64) for s in starts]))
        return seq[:, :-1], seq[:, 1:]


class Loader:
    """One rank's view of a source: the global batch index it reads next is its position.

    ``position`` counts micro-batches this rank has consumed; the global index is
    ``position * world_size + rank``. It is saved in every checkpoint.
    """

    def __init__(self, source: TokenSource, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1) -> None:
        self.source = source
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.position * self.world_size + self.rank
        self.position += 1
        return self.source.batch(index, TRAIN, self.batch_size, self.seq_len)

    def val_batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th evaluation batch of this rank (the same ones at every evaluation)."""
        return self.source.batch(i * self.world_size + self.rank, VAL, self.batch_size, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def one_document_batches(x: torch.Tensor, y: torch.Tensor, docs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch a loader without sequence-level shuffling gives: every row from ``docs`` document(s).

    A loader that reads each document's sequences in order fills a batch with consecutive chunks of
    one (long) document, so the batch averages over one document instead of ``batch_size``
    independent ones and its loss swings with that document (SmolLM3's noisier loss, seeds 004).
    The sources here are homogeneous (a Markov chain's chunks are as good as independent), so the
    one thing such a batch really loses, diversity, is made exact: the rows repeat the batch's
    first ``docs`` sequences. The tokens' distribution is unchanged; only the batch's make-up is.
    """
    n = x.shape[0]
    rows = torch.arange(n) * min(docs, n) // n
    return x[rows], y[rows]
