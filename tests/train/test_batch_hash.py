"""train.log_batch_hash: the hash names the global batch, not how its rows were read (the
multi-process all-gather is exercised by tests/sharding/test_multihost.py)."""

import numpy as np

from moetext.data.batch import from_tokens
from moetext.train.batch_hash import global_batch_hash


def _batch(seed: int):
    return from_tokens(np.random.default_rng(seed).integers(0, 512, (8, 17)).astype(np.int32))


def test_hash_depends_on_the_rows_not_on_the_order_a_process_holds_them():
    batch = _batch(0)
    want = global_batch_hash(batch, range(8), 8)
    assert len(want) == 16 and int(want, 16) >= 0
    # The same global rows held in another local order (a process's rows need not be sorted).
    order = np.random.default_rng(1).permutation(8)
    shuffled = {k: v[order] for k, v in batch.items()}
    assert global_batch_hash(shuffled, order.tolist(), 8) == want
    # Another batch, two rows swapped, or one token changed: another hash.
    assert global_batch_hash(_batch(2), range(8), 8) != want
    assert global_batch_hash(shuffled, range(8), 8) != want
    changed = {k: v.copy() for k, v in batch.items()}
    changed["tokens"][5, 3] += 1
    assert global_batch_hash(changed, range(8), 8) != want
