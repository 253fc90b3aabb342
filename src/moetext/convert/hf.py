"""Hugging Face checkpoints as moetext models: the Python API.

    cfg, model = load_model("path/to/Qwen3-30B-A3B", dtype="float32")
    logits_BSV, aux = model(tokens_BS)

config.json's model_type picks the model family (`models.family_for_hf`); the family's
adapter (`ModelFamily.hf`, models/hf.py) maps config.json and names every tensor; this module
reads the tensors (memory-mapped, one at a time) and places them in the model.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetext import models
from moetext.config.schema import Config, KernelsConfig
from moetext.convert.fp8 import dequantized
from moetext.convert.safetensors_io import SafetensorsReader
from moetext.errors import ConfigError
from moetext.models.hf import Fitted, HfAdapter, Tensor, TensorSource

DTYPES = ("float32", "bfloat16", "float16")


def read_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ConfigError(f"Hugging Face checkpoint directory {hf_dir} does not exist")
    if not path.exists():
        raise ConfigError(f"{path} is missing (every Hugging Face checkpoint has one)")
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def adapter_for(hf_config: dict[str, Any]) -> HfAdapter:
    """The HF adapter of the family that reads this config.json (by its model_type)."""
    adapter = models.family_for_hf(hf_config).hf
    assert adapter is not None  # family_for_hf only returns families with an adapter
    return adapter


def open_tensors(
    hf_dir: str | Path, adapter: HfAdapter, scratch: Path | None = None
) -> TensorSource:
    """The checkpoint's tensors as the adapter's tensor map reads them: memory-mapped, block-
    scaled FP8 weights dequantized to float32 (convert/fp8.py; into unlinked files under
    `scratch` when given), then the family's own preprocessing."""
    source = dequantized(SafetensorsReader(hf_dir), read_config(hf_dir), scratch)
    return adapter.wrap_source(source)


def fitted_config(hf_dir: str | Path) -> tuple[HfAdapter, Fitted, str]:
    """(the family's adapter, config.json's model and moe fitted to the stored tensors, the
    stored dtype); the adapter's warnings go to stderr, one `warning:` line each."""
    hf_config = read_config(hf_dir)
    adapter = adapter_for(hf_config)
    model_cfg, moe_cfg, stored = adapter.config_from_hf(hf_config)
    names = dequantized(SafetensorsReader(hf_dir), hf_config).names()  # scales hidden
    fitted = adapter.fit_config(model_cfg, moe_cfg, names)
    for line in fitted.warnings:
        print(f"warning: {line}", file=sys.stderr)
    return adapter, fitted, stored


def config_from_hf_dir(hf_dir: str | Path, dtype: str | None = None) -> Config:
    """A moetext Config for the checkpoint (model and moe from config.json, fitted to what the
    safetensors hold; other sections at their defaults). dtype sets param_dtype and compute
    dtype (default: the stored dtype)."""
    _, fitted, stored = fitted_config(hf_dir)
    dtype = dtype or stored
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    model_cfg = dataclasses.replace(fitted.model, param_dtype=dtype, dtype=dtype)  # type: ignore[arg-type]
    return Config(model=model_cfg, moe=fitted.moe)


FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(name: str, part: np.ndarray) -> None:
    """Weights are floating point: anything else is a broken or foreign checkpoint."""
    if part.dtype.name not in FLOAT_DTYPES:
        fp8 = " (an FP8 checkpoint needs config.json's quantization_config and block scales)"
        raise ConfigError(
            f"tensor {name} has dtype {part.dtype.name}; expected one of {', '.join(FLOAT_DTYPES)}"
            + (fp8 if part.dtype.name.startswith("float8") else "")
        )


def read_parts(reader: TensorSource, t: Tensor) -> list[np.ndarray]:
    """The HF tensors of `t` (memory-mapped), each checked for a float dtype and its shape, and
    its stored copies (`Tensor.copies`) checked equal to it."""
    parts = [reader.get(name) for name in t.hf_names]
    for name, part in zip(t.hf_names, parts, strict=True):
        _check_part(name, part, t)
    for name in t.copies:
        copy = reader.get(name)
        _check_part(name, copy, t)
        if copy.dtype != parts[0].dtype or not _equal(copy, parts[0]):
            raise ConfigError(
                f"tensor {name} differs from {t.hf_names[0]}; the checkpoint stores it as a "
                "copy of that tensor (they must be equal)"
            )
    return parts


def _check_part(name: str, part: np.ndarray, t: Tensor) -> None:
    check_dtype(name, part)
    if tuple(part.shape) != t.hf_shape:
        raise ConfigError(
            f"tensor {name} has shape {tuple(part.shape)}; config.json needs {t.hf_shape} "
            f"(moetext {'.'.join(map(str, t.path))} {t.shape})"
        )


def _equal(a: np.ndarray, b: np.ndarray, rows: int = 4096) -> bool:
    """Bitwise equal (NaNs included), a few thousand rows at a time: no whole-table temporary."""
    a2, b2 = a.reshape(len(a), -1), b.reshape(len(b), -1)
    view = np.dtype(f"u{a.dtype.itemsize}")
    return all(
        np.array_equal(a2[i : i + rows].view(view), b2[i : i + rows].view(view))
        for i in range(0, len(a2), rows)
    )


def check_tensors(reader: TensorSource, tensors: list[Tensor], tied: bool) -> None:
    """Every tensor the model needs (and every stored copy of one) is there and nothing else is
    (named either way)."""
    want = {n for t in tensors for n in (*t.hf_names, *t.copies)}
    have = set(reader.names())
    if tied:
        have.discard("lm_head.weight")  # some writers keep the tied head; it is the embedding
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}")
        if extra:
            parts.append(f"unexpected {len(extra)}: {', '.join(extra[:8])}")
        raise ConfigError(
            f"checkpoint {reader.directory} tensors do not match config.json: " + "; ".join(parts)
        )


def load_model(
    hf_dir: str | Path, dtype: str = "float32", kernels: KernelsConfig | None = None
) -> tuple[Config, nnx.Module]:
    """(config, model) with the checkpoint's weights; dtype sets param and compute dtype.
    The model is its family's, unscanned: model(tokens_BS) -> (logits_BSV, aux)."""
    cfg = config_from_hf_dir(hf_dir, dtype)
    if kernels is not None:
        cfg = dataclasses.replace(cfg, kernels=kernels)
    adapter = models.hf_adapter(cfg.model.family)
    reader = open_tensors(hf_dir, adapter)
    tensors = adapter.tensor_map(cfg.model, cfg.moe)
    check_tensors(reader, tensors, cfg.model.tie_embeddings)
    abstract = nnx.eval_shape(
        lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    )
    graphdef, state = nnx.split(abstract)
    # Model state HF does not store (a global-batch load buffer) starts as a new model's.
    initial = models.initial_model_state(cfg.model, cfg.moe, cfg.kernels)
    nnx.replace_by_pure_dict(state, nnx.to_pure_dict(initial))
    for t in tensors:
        parts = read_parts(reader, t)
        var: Any = state
        for key in t.path:
            var = var[key]
        as_dtype = jnp.dtype(dtype) if t.item == "params" else jnp.float32
        var.set_value(jnp.asarray(t.to_moetext(parts), dtype=as_dtype))
    return cfg, nnx.merge(graphdef, state)
