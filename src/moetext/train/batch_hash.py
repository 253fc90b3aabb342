"""`train.log_batch_hash`: a fingerprint of each step's global batch in metrics.jsonl.

It shows that a resumed run reads exactly the batches the uninterrupted run reads, whatever the
process count on either side: each process hashes its own rows (SHA-256 of every key's int32
row), the row digests are all-gathered, and the hash of the global batch is the SHA-256 of
the B row digests in row order (its first 16 hex digits). So it depends on the batch's
contents only, never on which process read which row.

Legend: B global rows (data.global_batch_size), L = S + 1 tokens per row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import jax
import numpy as np

from moetext.data.batch import Batch

_WORDS = 2  # a row's digest: the first 8 bytes of its SHA-256, as two uint32 words


def global_batch_hash(batch: Batch, rows: Sequence[int], global_rows: int) -> str:
    """The hash of the global batch whose rows `rows` this process holds (`batch`: [R, L])."""
    # [B, 1 + words]: a row this process holds is marked 1 and carries its digest.
    table_BW = np.zeros((global_rows, 1 + _WORDS), np.uint32)
    for i, r in enumerate(rows):
        h = hashlib.sha256()
        for key in sorted(batch):
            h.update(key.encode())
            h.update(np.ascontiguousarray(batch[key][i], np.int32).tobytes())
        table_BW[r, 0] = 1
        table_BW[r, 1:] = np.frombuffer(h.digest()[: 4 * _WORDS], np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        every_PBW = np.asarray(multihost_utils.process_allgather(table_BW))
        held_PB = every_PBW[..., 0] == 1
        missing = np.flatnonzero(~held_PB.any(axis=0))
        assert not missing.size, f"rows {missing[:8]} are read by no process"
        table_BW = every_PBW[held_PB.argmax(axis=0), np.arange(global_rows)]
    assert table_BW[:, 0].all(), "every row of the global batch is read by some process"
    return hashlib.sha256(np.ascontiguousarray(table_BW[:, 1:]).tobytes()).hexdigest()[:16]
