"""A params-only checkpoint written from host arrays (what `python -m moetext.convert
hf-to-orbax` produces): the same `state/` + `meta/` layout a run's `checkpoints/<step>/` has,
so that load_params_from, decoding and conversion back read either.

The arrays are NumPy (memory maps of the source, typically); orbax's NumPy handler would
deep-copy every one and write them all at once, copying the maps into anonymous memory as fast
as the disk falls behind. `write_params` writes them through `bounded_save.BoundedNumpyHandler`
instead: chunk-aligned boxes, at most WRITE_SLOTS x WRITE_BOX_BYTES in flight.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from moetext.checkpoint.bounded_save import BoundedNumpyHandler
from moetext.checkpoint.params import MODEL_STATE, PARAMS
from moetext.config import Config, to_dict

# Bytes in flight while writing: at most WRITE_SLOTS boxes of WRITE_BOX_BYTES (whole chunks).
# Each box in flight holds its encoded copy in anonymous memory until its file is written, so
# the product is the part of the peak that grows when the disk or the CPU falls behind (all
# slots full): 4 x 32 MiB allowed 128 MiB (one test run reached 103 MB of growth); 4 x 8 MiB
# (one chunk per box) caps it at 32 MiB (docs/convert.md, "Memory and disk").
WRITE_BOX_BYTES = 8 * 2**20
WRITE_SLOTS = 4
# Chunks of at most this many bytes: tensorstore encodes and writes a chunk at a time.
SAVE_ARGS = ocp.SaveArgs(chunk_byte_size=8 * 2**20)


def write_params(
    directory: epath.PathLike,
    params: Any,
    cfg: Config,
    extra_meta: dict[str, Any],
    model_state: Any = None,
) -> None:
    """Writes a new checkpoint `directory` (it must not exist) holding `params` (a tree of
    NumPy arrays, not changed during the write) as the state's params, `model_state` (likewise;
    None or empty: none) as its model_state, and as its meta step 0, `cfg` and `extra_meta`
    (e.g. where the params were converted from)."""
    writer = BoundedNumpyHandler(box_bytes=WRITE_BOX_BYTES, slots=WRITE_SLOTS)
    registry = ocp.type_handlers.create_type_handler_registry((np.ndarray, writer))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_ocdbt=False)
    ckptr = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(state=handler, meta=ocp.JsonCheckpointHandler())
    )
    meta = {"step": 0, "config": to_dict(cfg), **extra_meta}
    tree = {PARAMS: params}
    if model_state is not None and jax.tree.leaves(model_state):
        tree[MODEL_STATE] = model_state
    try:
        ckptr.save(
            epath.Path(directory),
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(tree, save_args=jax.tree.map(lambda _: SAVE_ARGS, tree)),
                meta=ocp.args.JsonSave(meta),
            ),
        )
    finally:
        ckptr.close()
