"""A moetext orbax checkpoint -> Hugging Face safetensors, streaming (through the family's HF
adapter).

    python -m moetext.convert orbax-to-hf --checkpoint DIR --out OUT [--config YML]
        [--dtype bfloat16] [--max_shard_size_gb 5] [--overwrite]

DIR is a run's `checkpoints/<step>/` or the output of hf-to-orbax (anything with `state/` and
`meta/`). The config is the one saved in `meta/` unless --config names another (it must then
describe the same shapes). OUT gets sharded safetensors (+ model.safetensors.index.json),
config.json (the spelling of the family's released checkpoints), generation_config.json and
the tokenizer files (DIR/tokenizer/, or the run's RUN_DIR/tokenizer/ for a step directory).

Parameters are restored one at a time (orbax partial restore of a single leaf, as NumPy), turned
into HF tensors and written; a scan_layers checkpoint restores one stacked leaf ([L, ...] of one
kind) at a time. Everything goes to a staging directory (convert/staging.py) renamed to OUT at
the end.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from moetext import config as config_lib
from moetext import models
from moetext.checkpoint import LeafReader, read_meta_config, saved_items, shape_mismatches
from moetext.config.schema import Config
from moetext.convert import safetensors_io
from moetext.convert.hf_to_orbax import np_dtype
from moetext.convert.staging import publish, refuse_existing, staging
from moetext.errors import ConfigError
from moetext.models.hf import ParamPath, Tensor


def _has(tree: dict[str, Any], path: ParamPath) -> bool:
    node: Any = tree
    for key in path:
        if not isinstance(node, dict) or str(key) not in node:
            return False
        node = node[str(key)]
    return True


def moetext_arrays(ckpt: Path, cfg: Config) -> Iterator[tuple[Tensor, np.ndarray]]:
    """Every tensor of the family's unscanned map with its array, one restored leaf at a time
    (from the checkpoint's params, or its model_state for a model-state tensor). A tensor the
    checkpoint holds in the scan_layers layout (`ModelFamily.stacked_path`) comes from its
    stacked leaf, restored once for all the layers it holds."""
    family = models.get_family(cfg.model.family)
    tensors = models.hf_adapter(cfg.model.family).tensor_map(cfg.model, cfg.moe)
    readers: dict[str, LeafReader] = {}
    stacks: dict[tuple[str, ParamPath], list[tuple[int, Tensor]]] = {}
    for t in tensors:
        if t.item not in readers:
            if t.item not in saved_items(ckpt):
                raise ConfigError(f"{ckpt} holds no {t.item}, which {t.hf_names[0]} comes from")
            readers[t.item] = LeafReader(ckpt, item=t.item)
        reader = readers[t.item]
        if _has(reader.tree, t.path) or family.stacked_path is None:
            yield t, reader.get(t.path)
            continue
        path, index = family.stacked_path(cfg.model, t.path)
        if index is None:
            yield t, reader.get(path)
        else:
            stacks.setdefault((t.item, path), []).append((index, t))
    for (item, path), members in stacks.items():
        stacked = readers[item].get(path)
        for index, t in members:
            yield t, stacked[index]


def _tokenizer_dir(ckpt: Path) -> Path | None:
    for d in (ckpt / "tokenizer", ckpt.parent.parent / "tokenizer"):
        if d.is_dir():
            return d
    return None


def orbax_to_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    config_path: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
) -> list[Path]:
    """Converts; returns the safetensors files (and index) written under OUT."""
    ckpt, out = Path(checkpoint), Path(out)
    if not ckpt.is_dir():
        raise ConfigError(f"checkpoint directory {ckpt} does not exist")
    cfg = read_meta_config(ckpt)
    if config_path is not None:
        given = config_lib.load(config_path)
        bad = shape_mismatches(cfg, given, "the checkpoint", str(config_path))
        if bad:
            raise ConfigError(f"{config_path} does not describe {ckpt}: " + "; ".join(bad))
        cfg = given
    adapter = models.hf_adapter(cfg.model.family)
    params = LeafReader(ckpt)
    stored = np.dtype(params.tree["embed"]["value"].dtype).name
    dtype = dtype or ("bfloat16" if stored == "bfloat16" else stored)
    hf_config = adapter.config_to_hf(cfg.model, cfg.moe, dtype)
    refuse_existing(out, overwrite)
    target = np_dtype(dtype)

    def named() -> Iterator[tuple[str, np.ndarray]]:
        for t, array in moetext_arrays(ckpt, cfg):
            as_dtype = target if t.item == "params" else np.float32  # model state stays f32
            arrays = t.to_hf(array.astype(as_dtype))
            yield from zip(t.hf_names, arrays, strict=True)
            for name in t.copies:  # e.g. DeepSeek-V3's MTP layer's embedding and head
                yield name, arrays[0]

    with staging(out) as stage:
        done = stage / "hf"
        done.mkdir()
        files = safetensors_io.write(done, named(), max_shard_bytes=max_shard_bytes)
        (done / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        tok = _tokenizer_dir(ckpt)
        if tok is not None:
            for f in sorted(tok.iterdir()):
                if f.is_file():
                    shutil.copy2(f, done / f.name)
        if not (done / "generation_config.json").exists():
            gen = {"_from_model_config": True}
            (done / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        publish(done, out)
    return [out / f.name for f in files]
