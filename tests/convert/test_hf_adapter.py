"""A family's HF adapter decides what conversion reads: the config.json model_type picks the
family, and the adapter's `wrap_source` preprocesses stored tensors (here: block-scaled weights,
as DeepSeek-V3 releases its FP8 experts with a `weight_scale_inv` per 128 x 128 block)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from moetext import models
from moetext.checkpoint import LeafReader, saved_items
from moetext.config.schema import KernelsConfig
from moetext.convert.hf import load_model
from moetext.convert.hf_to_orbax import hf_to_orbax
from moetext.convert.orbax_to_hf import orbax_to_hf
from moetext.convert.safetensors_io import SafetensorsReader, write
from moetext.errors import ConfigError
from moetext.models.hf import Tensor, TensorSource

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
BLOCK = 8  # the fixture's experts are [16, 32] / [32, 16]: 2 x 4 blocks
SCALE = "_scale_inv"
KIND = "scaled_qwen_test"


class BlockScaled:
    """The stored tensors with every `X` that has an `X_scale_inv` dequantized (X * the scale of
    its BLOCK x BLOCK block), the scale tensors hidden."""

    def __init__(self, source: TensorSource):
        self.source = source
        self.directory = source.directory

    def names(self) -> list[str]:
        return [n for n in self.source.names() if not n.endswith(SCALE)]

    def get(self, name: str) -> np.ndarray:
        x = np.asarray(self.source.get(name))
        if name + SCALE not in self.source.names():
            return x
        s = np.asarray(self.source.get(name + SCALE))
        full = np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1)[: x.shape[0], : x.shape[1]]
        return (x.astype(np.float32) * full).astype(x.dtype)


def _register() -> models.ModelFamily:
    qwen = models.get_family("qwen3_moe")
    assert qwen.hf is not None
    qwen_hf = qwen.hf

    def config_from_hf(hf: Mapping[str, Any]) -> Any:
        m, moe, dtype = qwen_hf.config_from_hf({**hf, "model_type": "qwen3_moe"})
        return dataclasses.replace(m, family=KIND), moe, dtype

    adapter = dataclasses.replace(
        qwen_hf, model_types=(KIND,), config_from_hf=config_from_hf, wrap_source=BlockScaled
    )
    return models.register_family(dataclasses.replace(qwen, name=KIND, hf=adapter), replace=True)


def _scaled_copy(tmp_path: Path) -> Path:
    """dense_first_t5 with each expert weight stored as w / s plus s per block, s a power of two
    (so w / s * s is w exactly)."""
    d = tmp_path / "scaled"
    shutil.copytree(FIXTURES / "dense_first_t5", d)
    reader = SafetensorsReader(d)
    tensors = {n: np.array(reader.get(n)) for n in reader.names()}
    del reader
    for name in [n for n in tensors if ".mlp.experts." in n]:
        w = tensors[name].astype(np.float32)
        rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
        s = np.ones((rows, cols), np.float32)
        for i in range(rows):
            for j in range(cols):
                block = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
                s[i, j] = 2.0 ** np.ceil(np.log2(np.abs(block).max()))
        full = np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1)[: w.shape[0], : w.shape[1]]
        tensors[name] = (w / full).astype(tensors[name].dtype)
        assert np.abs(tensors[name]).max() <= 1.0  # stored in [-1, 1], as a quantized range
        tensors[name + SCALE] = s
    (d / "model.safetensors").unlink()
    write(d, iter(tensors.items()), max_shard_bytes=1 << 30)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": KIND, "architectures": []}))
    return d


def test_the_adapter_preprocesses_what_conversion_reads(tmp_path):
    family = _register()
    d = _scaled_copy(tmp_path)
    kernels = KernelsConfig(gmm_backend="reference")
    cfg, model = load_model(d, kernels=kernels)
    assert cfg.model.family == KIND
    _, want_model = load_model(FIXTURES / "dense_first_t5", kernels=kernels)
    ids = np.load(FIXTURES / "dense_first_t5" / "input_ids.npy")
    got = np.asarray(jax.jit(lambda t: model(t)[0])(ids))
    want = np.asarray(jax.jit(lambda t: want_model(t)[0])(ids))
    np.testing.assert_array_equal(got, want)  # power-of-two scales: dequantized bit-exactly

    # Without the preprocessing the scale tensors are foreign to the tensor map.
    assert family.hf is not None
    plain = dataclasses.replace(family.hf, wrap_source=lambda s: s)
    models.register_family(dataclasses.replace(family, hf=plain), replace=True)
    with pytest.raises(ConfigError, match=r"unexpected \d+: model\.layers\.\d\.mlp\.experts"):
        load_model(d, kernels=kernels)


def test_a_model_type_no_family_reads_lists_the_ones_that_are_read(tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(FIXTURES / "dense_first_t5", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(
        ConfigError,
        match=r"model_type='llama', which no model family reads; supported: .*qwen2_moe "
        r"\(qwen3_moe\), qwen3_moe \(qwen3_moe\)",
    ):
        load_model(d)


def test_a_variant_reusing_an_adapter_does_not_take_its_model_types():
    qwen = models.get_family("qwen3_moe")
    models.register_family(dataclasses.replace(qwen, name="qwen_variant_test"), replace=True)
    for kind in ("qwen3_moe", "qwen2_moe"):
        assert models.family_for_hf({"model_type": kind}) is qwen


BIASED = "biased_qwen_test"
BIAS_NAME = "model.layers.{}.mlp.gate.e_score_correction_bias"


def _register_biased() -> models.ModelFamily:
    """Qwen3-MoE with DeepSeek-V3's router: a model-state tensor (the selection bias) in the map,
    as e_score_correction_bias (float32, like DeepSeek's released checkpoints)."""
    qwen = models.get_family("qwen3_moe")
    assert qwen.hf is not None
    qwen_hf = qwen.hf

    def config_from_hf(hf: Mapping[str, Any]) -> Any:
        m, moe, dtype = qwen_hf.config_from_hf({**hf, "model_type": "qwen3_moe"})
        moe = dataclasses.replace(moe, router="sigmoid_topk")
        return dataclasses.replace(m, family=BIASED), moe, dtype

    def config_to_hf(m: Any, moe: Any, dtype: str) -> dict[str, Any]:
        m = dataclasses.replace(m, family="qwen3_moe")
        out = qwen_hf.config_to_hf(m, dataclasses.replace(moe, router="softmax_topk"), dtype)
        return {**out, "model_type": BIASED}

    def tensor_map(m: Any, moe: Any) -> list[Tensor]:
        moe_layers = qwen.moe_layers(m)
        bias = [
            Tensor(
                ("layers", i, "mlp", "router", "selection_bias"),
                (BIAS_NAME.format(i),),
                (moe.num_experts,),
                "same",
                item="model_state",
            )
            for i, is_moe in enumerate(moe_layers)
            if is_moe
        ]
        return [*qwen_hf.tensor_map(m, moe), *bias]

    adapter = dataclasses.replace(
        qwen_hf,
        model_types=(BIASED,),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensor_map=tensor_map,
    )
    return models.register_family(dataclasses.replace(qwen, name=BIASED, hf=adapter), replace=True)


def test_model_state_tensors_convert_both_ways_in_float32(tmp_path):
    # dense_first_t5 plus a float32 selection bias per MoE layer: hf-to-orbax puts the bias in
    # the checkpoint's model_state (not params), loads and exports it bit-exactly.
    family = _register_biased()
    d = tmp_path / "biased"
    shutil.copytree(FIXTURES / "dense_first_t5", d)
    reader = SafetensorsReader(d)
    tensors = {n: np.array(reader.get(n)) for n in reader.names()}
    del reader
    cfg_json = json.loads((d / "config.json").read_text())
    m, moe, _ = family.hf.config_from_hf(cfg_json)
    moe_layers = [i for i, x in enumerate(family.moe_layers(m)) if x]
    rng = np.random.default_rng(0)
    biases = {i: rng.standard_normal(moe.num_experts).astype(np.float32) for i in moe_layers}
    tensors.update({BIAS_NAME.format(i): b for i, b in biases.items()})
    (d / "model.safetensors").unlink()
    write(d, iter(tensors.items()), max_shard_bytes=1 << 30)
    (d / "config.json").write_text(json.dumps({**cfg_json, "model_type": BIASED}))

    _, model = load_model(d, dtype="bfloat16", kernels=KernelsConfig(gmm_backend="reference"))
    for i, b in biases.items():
        np.testing.assert_array_equal(model.layers[i].mlp.router.selection_bias[...], b)

    ckpt = tmp_path / "orbax"
    hf_to_orbax(d, ckpt, dtype="bfloat16")
    assert "model_state" in saved_items(ckpt)
    state = LeafReader(ckpt, item="model_state")
    for i, b in biases.items():
        got = state.get(("layers", i, "mlp", "router", "selection_bias"))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, b)

    out = tmp_path / "back"
    orbax_to_hf(ckpt, out)
    back = SafetensorsReader(out)
    for i, b in biases.items():
        got = np.asarray(back.get(BIAS_NAME.format(i)))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, b)
    assert json.loads((out / "config.json").read_text())["model_type"] == BIASED
