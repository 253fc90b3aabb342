"""Batch placement: which global rows this process holds, and host rows as sharded arrays.

A batch (moetext.data.batch) is a dict of int32 tokens, segment_ids and positions (and
loss_mask for chat data), each [B, S + 1]; `put_batch` turns this process's rows into global
arrays on the plan's batch sharding, `abstract_batch` describes one for ahead-of-time lowering.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, Sharding

from moetext.data.batch import KEYS


def local_rows(sharding: NamedSharding, global_rows: int) -> list[int]:
    """The global batch rows this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map((global_rows, 1))
    return sorted(
        {r for idx in index_map.values() if idx for r in range(*idx[0].indices(global_rows))}
    )


def put_batch(
    batch: dict[str, np.ndarray],
    sharding: NamedSharding,
    rows: Sequence[int] | None = None,
    global_rows: int | None = None,
) -> dict[str, jax.Array]:
    """Batch rows as global sharded arrays: each device gets its rows.

    `batch` holds the global batch, or with `rows` only those global rows (this process's,
    see local_rows) out of `global_rows`.
    """
    n = len(next(iter(batch.values())))
    rows, global_rows = (range(n), n) if rows is None else (rows, global_rows or n)
    where = {r: i for i, r in enumerate(rows)}

    def put(v: np.ndarray) -> jax.Array:
        def shard(idx: tuple[slice, ...] | None) -> np.ndarray:
            assert idx is not None  # a batch is never a scalar
            picked = [where[r] for r in range(*idx[0].indices(global_rows))]
            return v[picked][(slice(None), *idx[1:])]

        return jax.make_array_from_callback((global_rows, *v.shape[1:]), sharding, shard)

    return {k: put(v) for k, v in batch.items()}


def abstract_batch(
    batch_size: int, seq_len: int, sharding: Sharding, keys: Sequence[str] = KEYS
) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch as ShapeDtypeStructs (int32 [B, S + 1] each) for ahead-of-time lowering:
    `keys` those the run's data yields (moetext.data.batch.batch_keys(cfg.data.kind): chat
    data adds loss_mask)."""
    shape = (batch_size, seq_len + 1)
    # jax: ShapeDtypeStruct.__init__ is unannotated.
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in keys}  # type: ignore[no-untyped-call]
