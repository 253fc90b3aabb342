"""Block-scaled FP8 checkpoints (convert/fp8.py) against a float64 NumPy oracle: several blocks,
partial edge blocks, non-square blocks, a block larger than the tensor; what stays high
precision passes through untouched; bad input fails naming the tensor or field."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from moetext.convert.fp8 import Dequantized, dequantized
from moetext.convert.safetensors_io import SafetensorsReader, write
from moetext.errors import ConfigError

FP8 = ml_dtypes.float8_e4m3fn


def _config(block=(4, 8), **extra):
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    q["weight_block_size"] = list(block)
    return {"quantization_config": {**q, **extra}}


def _quantized(rng, shape, block):
    """(fp8 weight, float32 scale_inv) with scales spread over 2^-6..2^3 and not powers of two,
    so each block's scale matters and the product rounds."""
    w = rng.uniform(-448, 448, shape).astype(FP8)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    s = (rng.uniform(0.5, 1.0, grid) * 2.0 ** rng.integers(-6, 4, grid)).astype(np.float32)
    return w, s


def _oracle(w, s, block):
    """float64 W[r, c] * S[r // br, c // bc], by index arithmetic (not the block-row loop)."""
    r = np.arange(w.shape[0])[:, None] // block[0]
    c = np.arange(w.shape[1])[None, :] // block[1]
    return w.astype(np.float64) * s.astype(np.float64)[r, c]


def _checkpoint(tmp_path: Path, tensors: dict[str, np.ndarray]) -> SafetensorsReader:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    write(d, iter(tensors.items()), max_shard_bytes=1 << 30)
    return SafetensorsReader(d)


@pytest.mark.parametrize(
    "shape, block",
    [
        ((13, 21), (4, 8)),  # 4 x 3 blocks, partial in both dims
        ((16, 24), (4, 8)),  # whole blocks only
        ((9, 5), (2, 3)),  # non-square blocks, partial edges
        ((6, 7), (128, 128)),  # one partial block (the released block size, a small tensor)
    ],
)
def test_dequantized_weights_match_the_float64_oracle(tmp_path, shape, block):
    rng = np.random.default_rng(sum(shape) + sum(block))
    w, s = _quantized(rng, shape, block)
    norm = rng.standard_normal(shape[1]).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(shape[0]).astype(np.float32)
    reader = _checkpoint(
        tmp_path,
        {
            "a.weight": w,
            "a.weight_scale_inv": s,
            "norm.weight": norm,
            "gate.e_score_correction_bias": bias,
        },
    )
    for scratch in (None, tmp_path / "scratch"):
        if scratch is not None:
            scratch.mkdir()
        source = dequantized(reader, _config(block), scratch)
        assert source.names() == ["a.weight", "gate.e_score_correction_bias", "norm.weight"]
        got = source.get("a.weight")
        assert got.dtype == np.float32 and got.shape == shape
        # One float32 multiply of two exact float32 values: the oracle rounded to float32.
        np.testing.assert_array_equal(got, _oracle(w, s, block).astype(np.float32))
        # High-precision tensors pass through bit for bit, in their stored dtype.
        assert source.get("norm.weight").dtype == norm.dtype
        np.testing.assert_array_equal(source.get("norm.weight"), norm)
        np.testing.assert_array_equal(source.get("gate.e_score_correction_bias"), bias)
        if scratch is not None:
            assert list(scratch.iterdir()) == []  # the file is unlinked once mapped
            del got


def test_no_quantization_config_is_the_identity(tmp_path):
    reader = _checkpoint(tmp_path, {"a.weight": np.ones((2, 2), np.float32)})
    assert dequantized(reader, {}) is reader


def test_bad_fp8_checkpoints_fail_naming_the_tensor(tmp_path):
    rng = np.random.default_rng(0)
    w, s = _quantized(rng, (13, 21), (4, 8))
    reader = _checkpoint(
        tmp_path,
        {
            "good.weight": w,
            "good.weight_scale_inv": s,
            "unscaled.weight": w,
            "wrong_grid.weight": w,
            "wrong_grid.weight_scale_inv": s[:3],
            "scaled_bf16.weight": w.astype(ml_dtypes.bfloat16),
            "scaled_bf16.weight_scale_inv": s,
        },
    )
    source = Dequantized(reader, (4, 8))
    with pytest.raises(
        ConfigError,
        match=r"^tensor unscaled\.weight is float8_e4m3fn but the checkpoint has no "
        r"unscaled\.weight_scale_inv",
    ):
        source.get("unscaled.weight")
    with pytest.raises(
        ConfigError,
        match=r"^tensor wrong_grid\.weight_scale_inv has shape \(3, 3\); wrong_grid\.weight "
        r"\(13, 21\) in 4 x 8 blocks \(quantization_config\.weight_block_size\) needs \(4, 3\)",
    ):
        source.get("wrong_grid.weight")
    with pytest.raises(ConfigError, match=r"^tensor scaled_bf16\.weight has a .* dtype bfloat16"):
        source.get("scaled_bf16.weight")
    # The same checkpoint read with another block size: the scale grid no longer fits.
    with pytest.raises(ConfigError, match=r"good\.weight_scale_inv has shape \(4, 3\).*\(7, 3\)"):
        Dequantized(reader, (2, 8)).get("good.weight")


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"quantization_config": {"quant_method": "compressed-tensors"}},
            r"quant_method='compressed-tensors' is not supported; supported: fp8",
        ),
        (_config(fmt="e5m2"), r"quantization_config\.fmt='e5m2' is not supported"),
        (_config(block=(128,)), r"weight_block_size=\[128\] must be two positive integers"),
        (_config(block=(0, 128)), r"weight_block_size=\[0, 128\] must be two positive"),
    ],
)
def test_unsupported_quantization_configs_fail_naming_the_field(tmp_path, config, match):
    reader = _checkpoint(tmp_path, {"a.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(ConfigError, match=match):
        dequantized(reader, config)
