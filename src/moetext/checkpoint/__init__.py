"""The on-disk checkpoint format, alone: everything that reads or writes it goes through here.

    manager.py       a run's train state under <run_dir>/checkpoints/<step>/: save (async),
                     resume newest to oldest past broken steps (`Checkpointer`)
    config_check.py  what a checkpoint's config must match, from the fields' own declarations
                     (`moetext.config.fields`): on resume (`check_config`), for loaded params
                     (`shape_mismatches`)
    meta.py          the meta item (step, resolved config): `read_meta_config`
    params.py        params-only reads: `load_params` (and `load_model_state`) onto a run's
                     shardings (either layer
                     layout), `read_item` for any named item of the saved state, `LeafReader`
                     one NumPy leaf at a time
    write.py         a params-only checkpoint from host arrays (conversion), through
    bounded_save.py  orbax's NumPy handler with a bound on the bytes in flight
    orbax_noise.py   quiets orbax's and tensorstore's own reports of a failure reported here

Imports only `moetext.errors` and `moetext.config`: what the model's params look like comes
from the caller (`ParamsTarget`).
"""

from moetext.checkpoint.config_check import check_config, shape_mismatches
from moetext.checkpoint.errors import CheckpointError, CheckpointWriteError
from moetext.checkpoint.manager import Checkpointer, abstract_like
from moetext.checkpoint.meta import read_meta_config
from moetext.checkpoint.params import (
    LeafReader,
    Params,
    ParamsTarget,
    load_model_state,
    load_params,
    read_item,
    saved_items,
)
from moetext.checkpoint.write import write_params

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "LeafReader",
    "Params",
    "ParamsTarget",
    "abstract_like",
    "check_config",
    "load_model_state",
    "load_params",
    "read_item",
    "read_meta_config",
    "saved_items",
    "shape_mismatches",
    "write_params",
]
