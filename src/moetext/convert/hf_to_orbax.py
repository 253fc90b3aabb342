"""Hugging Face safetensors -> a moetext orbax checkpoint, streaming (any family with an HF
adapter; config.json's model_type picks it).

    python -m moetext.convert hf-to-orbax --hf DIR --out OUT [--config YML] [--dtype bfloat16]
        [--emit_config] [--overwrite]

OUT is laid out like a run's `checkpoints/<step>/`: `state/` (an orbax PyTree {"params": ...}
of the unscanned model, the stored dtype kept unless --dtype, and {"model_state": ...} when the
model has ModelState variables: the tensors HF stores for them in float32, else their initial
values), `meta/` (step 0 and the
resolved config), plus a self-contained `config.yml` and `tokenizer/` with the source's
tokenizer files. A run with `scan_layers` restacks the layers when it loads them.

Memory: each HF tensor is memory-mapped; a parameter whose layout or dtype changes is written
into a memory-mapped scratch file under OUT's staging directory (file pages, not anonymous
memory), and `checkpoint.write_params` writes from those maps a few chunk-aligned boxes at a
time, each box's write awaited before the next starts (`checkpoint/bounded_save.py`, at most
`WRITE_SLOTS` x `WRITE_BOX_BYTES` in flight). The peak anonymous memory is therefore a few
boxes, not the model, however slow the disk (tests/convert/test_streaming_memory.py measures
it). Everything is written to a staging directory
next to OUT and renamed at the end, so a failed conversion leaves nothing at OUT.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import yaml
from flax import nnx

from moetext import config as config_lib
from moetext import models
from moetext.checkpoint import shape_mismatches, write_params
from moetext.config.schema import Config
from moetext.convert.hf import (
    DTYPES,
    check_tensors,
    fitted_config,
    open_tensors,
    read_config,
    read_parts,
)
from moetext.convert.staging import publish, refuse_existing, staging
from moetext.errors import ConfigError
from moetext.models.hf import Tensor, TensorSource, hf_dtype

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
)


def np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def derive_config(hf_dir: str | Path, config_path: str | Path | None) -> Config:
    """The run config for the checkpoint: from config.json (fitted to the stored tensors), or
    `config_path` checked against it."""
    _, fitted, _ = fitted_config(hf_dir)
    from_json = Config(model=fitted.model, moe=fitted.moe)
    if config_path is None:
        return from_json
    cfg = config_lib.load(config_path)
    bad = shape_mismatches(cfg, from_json, str(config_path), "config.json")
    if bad:
        raise ConfigError(f"{config_path} does not describe {hf_dir}: " + "; ".join(bad))
    return cfg


def _unscanned(cfg: Config) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))


def abstract_params(cfg: Config, kind: Any = nnx.Param) -> nnx.State[Any, Any]:
    """The unscanned model's nnx.Param (or other `kind`: models.ModelState) state of
    ShapeDtypeStructs (what a checkpoint holds)."""
    c = _unscanned(cfg)
    model = nnx.eval_shape(lambda: models.build(c.model, c.moe, c.kernels, rngs=nnx.Rngs(0)))
    return nnx.state(model, kind)


def initial_model_state(cfg: Config) -> nnx.State[Any, Any]:
    """The unscanned model's ModelState as a new model starts it, as NumPy (the params' init
    is dropped by jit): what a converted checkpoint holds where HF stores no tensor."""
    c = _unscanned(cfg)
    state = models.initial_model_state(c.model, c.moe, c.kernels)
    out: nnx.State[Any, Any] = jax.tree.map(np.asarray, state)
    return out


def _leaf(params: nnx.State[Any, Any], path: tuple[str | int, ...]) -> Any:
    node: Any = params
    for key in path:
        node = node[key]
    return node


def _mapped(reader: TensorSource, t: Tensor, dtype: np.dtype[Any], scratch: Path) -> np.ndarray:
    """The moetext array of `t`, as a memory map: the HF tensor itself when nothing changes,
    else a scratch file filled one HF tensor (one expert) at a time."""
    parts = read_parts(reader, t)
    if t.kind == "same" and parts[0].dtype == dtype:
        return parts[0]
    path = scratch / f"{len(list(scratch.iterdir())):06d}.bin"
    out = np.memmap(path, dtype, "w+", shape=t.shape)
    if t.kind == "experts":
        for e, part in enumerate(parts):
            np.copyto(out[e], np.asarray(part).T, casting="unsafe")
    elif t.kind == "same":
        np.copyto(out, parts[0], casting="unsafe")
    elif t.kind == "bias_heads":
        np.copyto(out.reshape(t.hf_shape), parts[0], casting="unsafe")
    else:  # [out, in] -> [in, out], then heads split: a view of `out` takes the copy directly
        flat = out.reshape(t.hf_shape[1], t.hf_shape[0])
        np.copyto(flat, np.asarray(parts[0]).T, casting="unsafe")
    out.flush()
    return np.memmap(path, dtype, "r", shape=t.shape)


def hf_to_orbax(
    hf_dir: str | Path,
    out: str | Path,
    *,
    config_path: str | Path | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Config:
    """Converts; returns the config written to OUT/config.yml."""
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = derive_config(hf_dir, config_path)
    stored = hf_dtype(read_config(hf_dir))
    dtype = dtype or stored
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    refuse_existing(out, overwrite)
    adapter = models.hf_adapter(cfg.model.family)
    check_tensors(
        open_tensors(hf_dir, adapter),
        adapter.tensor_map(cfg.model, cfg.moe),
        cfg.model.tie_embeddings,
    )
    tokenizer = [hf_dir / f for f in TOKENIZER_FILES if (hf_dir / f).exists()]
    if not any(f.name == "tokenizer.json" for f in tokenizer):
        print(
            f"warning: {hf_dir} has no tokenizer.json; {out} will have no tokenizer/",
            file=sys.stderr,
        )

    with staging(out) as stage:
        scratch = stage / "scratch"
        scratch.mkdir()
        # FP8 weights dequantize into unlinked files there (file pages, not anonymous memory).
        reader = open_tensors(hf_dir, adapter, scratch)
        tensors = adapter.tensor_map(cfg.model, cfg.moe)
        items = {"params": abstract_params(cfg), "model_state": initial_model_state(cfg)}
        target = np_dtype(dtype)
        for t in tensors:
            var = _leaf(items[t.item], t.path)
            as_dtype = target if t.item == "params" else np.dtype(np.float32)
            var.set_value(_mapped(reader, t, as_dtype, scratch))
        ckpt = stage / "checkpoint"
        converted_from = {"hf": str(hf_dir.resolve()), "dtype": dtype}
        meta = {"converted_from": converted_from}
        write_params(ckpt, items["params"], cfg, meta, model_state=items["model_state"])
        del items
        config_lib.save(cfg, ckpt / "config.yml")
        if tokenizer:
            (ckpt / "tokenizer").mkdir()
            for f in tokenizer:
                shutil.copy2(f, ckpt / "tokenizer" / f.name)
        publish(ckpt, out)
    return cfg


def emit_config(cfg: Config) -> str:
    """The config.yml text (self-contained: no base_config)."""
    return str(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
