"""The batch every input pipeline yields and every step consumes.

A batch is a dict of int32 arrays, each [B, S + 1] (B global rows, S = data.seq_len):

- `tokens`: token ids; the step predicts tokens[:, 1:] from tokens[:, :-1].
- `segment_ids`: which document of the row a token belongs to (1, 2, ... in row order);
  0 marks padding. Attention never crosses segments.
- `positions`: the token's position inside its document (RoPE positions). A document that
  continues from the previous row keeps counting.

- `loss_mask` (chat data only, moetext.data.chat_pipeline): 1 where the token is one the
  model should learn to produce (an assistant turn's content and end-of-turn token), 0
  elsewhere (system and user turns, role headers, padding).

A target counts in the loss only when it is not padding, belongs to the same segment as
its input token (so no token is predicted from another document's context) and, when the
batch has a loss_mask, is marked there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import jax

KEYS = ("tokens", "segment_ids", "positions")
LOSS_MASK = "loss_mask"
CHAT_KEYS = (*KEYS, LOSS_MASK)

Batch = dict[str, np.ndarray]


def from_tokens(tokens_BS1: np.ndarray) -> Batch:
    """One document per row, no padding: segment 1 everywhere, positions 0..S."""
    tokens_BS1 = np.asarray(tokens_BS1, np.int32)
    if tokens_BS1.ndim != 2:
        raise ValueError(f"tokens must be [B, S + 1], got shape {tokens_BS1.shape}")
    b, s1 = tokens_BS1.shape
    return {
        "tokens": tokens_BS1,
        "segment_ids": np.ones((b, s1), np.int32),
        "positions": np.broadcast_to(np.arange(s1, dtype=np.int32), (b, s1)).copy(),
    }


def batch_keys(kind: str) -> tuple[str, ...]:
    """The keys of the batches that data.kind's pipeline yields (what a step compiled ahead of
    time must take: the trainer feeds exactly these)."""
    return CHAT_KEYS if kind == "chat" else KEYS


def target_mask[A: (np.ndarray, jax.Array)](batch: Mapping[str, A]) -> A:
    """[B, S] bool: targets that count in the loss (not padding, same document as the input,
    and marked in the batch's loss_mask when it has one). NumPy or jax arrays alike (the train
    step and the data statistics share it)."""
    seg = batch["segment_ids"]
    # Annotated: numpy's stubs type comparisons of an array of unknown dtype as Any.
    mask: A = (seg[:, 1:] != 0) & (seg[:, 1:] == seg[:, :-1])
    if LOSS_MASK in batch:
        mask = mask & (batch[LOSS_MASK][:, 1:] != 0)
    return mask


def unigram_entropy(batches: list[Batch]) -> float:
    """Entropy (nats) of the counted targets' own token frequencies: the loss of the best
    context-free model of these very tokens, a floor a language model must get below."""
    targets = np.concatenate([b["tokens"][:, 1:][target_mask(b)] for b in batches])
    p = np.unique(targets, return_counts=True)[1] / max(len(targets), 1)
    return float(-(p * np.log(p)).sum())
