"""Block-scaled FP8 checkpoints, dequantized as they are read (DeepSeek-V3/R1, Kimi K2, and any
checkpoint with transformers' fine-grained FP8 `quantization_config`).

DeepSeek-V3's released safetensors store the attention, dense-MLP and expert projections as
`float8_e4m3fn` W [rows, cols] with a float32 `weight_scale_inv` S [ceil(rows / br),
ceil(cols / bc)] beside each, (br, bc) = config.json `quantization_config.weight_block_size`
([128, 128] as released; any size works, and an edge block may be partial):

    W_deq[r, c] = float32(W[r, c]) * S[r // br, c // bc]

Everything else (embeddings, the head, norms, the router gate, `e_score_correction_bias`) is
stored in high precision and passes through. `dequantized(source, config.json)` is the
checkpoint as the tensor map reads it: each `X.weight` with an `X.weight_scale_inv` comes back
dequantized to float32 (the converter then casts to the dtype asked for), the scale tensors are
hidden. One tensor is dequantized at a time, one block row at a time: into anonymous memory, or,
with `scratch`, into an unlinked file there (file pages, reclaimable; its disk space is freed
when the array is dropped), so a conversion's anonymous memory stays a block row (br x cols x
4 bytes), not a tensor.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from moetext.errors import ConfigError
from moetext.models.hf import TensorSource

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIX = "_scale_inv"
QUANT_METHODS = ("fp8",)
"""quantization_config.quant_method values read (transformers' FineGrainedFP8 = DeepSeek's)."""
DEFAULT_BLOCK = (128, 128)
"""transformers' FineGrainedFP8Config default, for a quantization_config without a block size."""


def scale_name(name: str) -> str:
    """`X.weight` -> `X.weight_scale_inv` (the name DeepSeek's checkpoints give the scale)."""
    return name + SCALE_SUFFIX


def block_size(hf_config: Mapping[str, Any]) -> tuple[int, int] | None:
    """(br, bc) of config.json's block-scaled FP8 quantization_config; None without one. Other
    quantization methods fail naming the method and what is read."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(
            f"config.json quantization_config.quant_method={method!r} is not supported; "
            f"supported: {', '.join(QUANT_METHODS)} (block-scaled float8_e4m3fn with "
            "weight_scale_inv, as DeepSeek-V3 releases its weights)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(
            f"config.json quantization_config.fmt={fmt!r} is not supported (needs 'e4m3')"
        )
    block = q.get("weight_block_size") or DEFAULT_BLOCK
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"config.json quantization_config.weight_block_size={block!r} must be two positive "
            "integers [rows, cols]"
        )
    return int(block[0]), int(block[1])


class Dequantized:
    """`source` with each FP8 weight dequantized to float32 and its scale tensor hidden (see
    the module docstring); a TensorSource."""

    def __init__(self, source: TensorSource, block: tuple[int, int], scratch: Path | None = None):
        self.source = source
        self.block = block
        self.scratch = scratch
        self._names = set(source.names())

    @property
    def directory(self) -> Any:
        return self.source.directory

    def names(self) -> list[str]:
        # A scale whose weight is missing stays visible: the converter names it as unexpected.
        return sorted(
            n
            for n in self._names
            if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self._names)
        )

    def get(self, name: str) -> np.ndarray:
        w = self.source.get(name)
        scale = scale_name(name)
        if scale not in self._names:
            if w.dtype == FP8:
                raise ConfigError(
                    f"tensor {name} is float8_e4m3fn but the checkpoint has no {scale} "
                    "(the block scales every FP8 weight needs)"
                )
            return w
        if w.dtype != FP8:
            raise ConfigError(
                f"tensor {name} has a {scale} but dtype {w.dtype.name}; a block-scaled weight "
                "is float8_e4m3fn"
            )
        s = self.source.get(scale)
        (br, bc), (rows, cols) = self.block, (w.shape + (0, 0))[:2]
        want = (-(-rows // br), -(-cols // bc))
        if w.ndim != 2 or tuple(s.shape) != want:
            raise ConfigError(
                f"tensor {scale} has shape {tuple(s.shape)}; {name} {tuple(w.shape)} in "
                f"{br} x {bc} blocks (quantization_config.weight_block_size) needs {want}"
            )
        if s.dtype.name not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"tensor {scale} has dtype {s.dtype.name}; expected a float dtype")
        return dequantize(w, s, self.block, out=self._output(w.shape))

    def _output(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.scratch is None:
            return np.empty(shape, np.float32)
        # An unlinked file: the map keeps it alive, dropping the array frees its disk space.
        with tempfile.TemporaryFile(dir=self.scratch) as f:
            f.truncate(int(np.prod(shape)) * 4)
            return np.memmap(f, np.float32, "r+", shape=shape)


def dequantize(
    w_RC: np.ndarray, s: np.ndarray, block: tuple[int, int], out: np.ndarray | None = None
) -> np.ndarray:
    """float32 w_RC * s[r // br, c // bc], one block row at a time (into `out` when given)."""
    br, bc = block
    rows, cols = w_RC.shape
    out = np.empty((rows, cols), np.float32) if out is None else out
    s32 = np.asarray(s, np.float32)
    for i in range(s32.shape[0]):
        r = slice(i * br, min((i + 1) * br, rows))
        scale_C = np.repeat(s32[i], bc)[:cols]
        np.multiply(np.asarray(w_RC[r], np.float32), scale_C, out=out[r])
    return out


def dequantized(
    source: TensorSource, hf_config: Mapping[str, Any], scratch: Path | None = None
) -> TensorSource:
    """The checkpoint's tensors with block-scaled FP8 weights dequantized (identity for a
    checkpoint without quantization_config)."""
    block = block_size(hf_config)
    if block is None:
        return source
    return Dequantized(source, block, scratch)
