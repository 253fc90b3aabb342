"""Deterministic synthetic token stream with learnable structure.

Tokens follow a fixed sparse Markov chain (each token has a few likely successors, drawn
from the data seed), with a small probability of a uniformly random token. A model can learn
the chain, so the loss falls towards the chain's entropy; a batch is a pure function of
(seed, split, step), which makes resume exact: the data position is the step counter.

Shapes: B global batch, S sequence length; a batch (moetext.data.batch) holds S + 1 tokens
per row so that inputs = tokens[:, :-1] and targets = tokens[:, 1:]; each row is one document.
"""

from __future__ import annotations

import numpy as np

from moetext.config import DataConfig
from moetext.data.batch import Batch, from_tokens

_SUCCESSORS = 4  # likely next tokens per token
_NOISE = 0.1  # probability of a uniformly random token instead of a chain step
_SPLITS = {"train": 0, "eval": 1}


class SyntheticData:
    """Global batches (tokens, segment_ids, positions; int32 [B, S + 1]), indexed by step."""

    def __init__(self, cfg: DataConfig, vocab_size: int):
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs vocab_size >= 2, got {vocab_size}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        table_rng = np.random.default_rng([cfg.seed, 7919])
        self.successors_VN = table_rng.integers(0, vocab_size, (vocab_size, _SUCCESSORS))
        # Skewed successor probabilities make the chain's entropy well below log(vocab).
        p = np.array([0.55, 0.25, 0.12, 0.08])[:_SUCCESSORS]
        self.successor_cdf = np.cumsum(p / p.sum())

    def batch(self, step: int, split: str = "train") -> Batch:
        return from_tokens(self.tokens(step, split))

    def tokens(self, step: int, split: str = "train") -> np.ndarray:
        if split not in _SPLITS:
            raise ValueError(f"unknown data split {split!r}; valid: {list(_SPLITS)}")
        b, s = self.cfg.global_batch_size, self.cfg.seq_len
        rng = np.random.default_rng([self.cfg.seed, _SPLITS[split], step])
        tokens_BS = np.empty((b, s + 1), np.int32)
        tokens_BS[:, 0] = rng.integers(0, self.vocab_size, b)
        pick = np.searchsorted(self.successor_cdf, rng.random((b, s)))
        noise = rng.random((b, s)) < _NOISE
        uniform = rng.integers(0, self.vocab_size, (b, s))
        for t in range(s):
            nxt = self.successors_VN[tokens_BS[:, t], pick[:, t]]
            tokens_BS[:, t + 1] = np.where(noise[:, t], uniform[:, t], nxt)
        return tokens_BS

    def entropy_floor(self) -> float:
        """Per-token entropy (nats) of the chain: the loss a perfect model approaches."""
        p = np.diff(np.concatenate([[0.0], self.successor_cdf]))
        v = self.vocab_size
        # Mixture of the chain step (prob 1 - noise) and uniform noise; duplicates in the
        # successor table are ignored here, so this is a close upper bound of the true entropy.
        q = (1 - _NOISE) * p + _NOISE / v
        rest = v - len(p)
        return float(-(q * np.log(q)).sum() - rest * (_NOISE / v) * np.log(_NOISE / v))
