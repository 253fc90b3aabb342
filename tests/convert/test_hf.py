"""Hugging Face Qwen3-MoE checkpoints in moetext: logits equal transformers' (stored fixtures
made by scripts/make_hf_fixture.py), and every malformed checkpoint fails naming what is wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from moetext.config.schema import KernelsConfig
from moetext.convert.hf import load_model
from moetext.convert.safetensors_io import SafetensorsReader, write
from moetext.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NAMES = ["dense_first_t5", "sparse_step_released", "qwen2_shared_expert", "qwen3_chat"]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", NAMES)
def test_float32_logits_match_transformers(name):
    d = FIXTURES / name
    cfg, model = load_model(d, dtype="float32", kernels=KernelsConfig(gmm_backend="reference"))
    ids = np.load(d / "input_ids.npy")
    want = np.load(d / "logits.npy")
    got, aux = jax.jit(lambda t: model(t))(ids)
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == np.float32
    # Both sides are float32 with different summation orders: 1e-4 absolute on logits of
    # magnitude ~10 is ~1e-5 relative, far below any real mapping error (a swapped head or a
    # transposed expert changes logits by O(1)).
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    p = np.exp(_log_softmax(want))
    kl = (p * (_log_softmax(want) - _log_softmax(got))).sum(-1).mean()
    assert kl <= 1e-6, kl
    assert "expert_load" in aux


def test_configs_read_from_both_spellings():
    a, _ = load_model(FIXTURES / "dense_first_t5")
    b, _ = load_model(FIXTURES / "sparse_step_released")
    assert (a.moe.num_experts, a.model.rope_theta, a.model.head_dim) == (4, 10000.0, 16)
    assert a.model.mlp_only_layers == (0,) and not a.moe.norm_topk_prob
    assert (b.moe.num_experts, b.model.rope_theta, b.model.rms_norm_eps) == (6, 1e6, 1e-5)
    assert b.model.decoder_sparse_step == 2 and b.moe.norm_topk_prob and b.model.tie_embeddings
    assert a.model.param_dtype == a.model.dtype == "float32"
    bf16, model = load_model(FIXTURES / "dense_first_t5", dtype="bfloat16")
    assert bf16.model.dtype == "bfloat16" and model.embed[...].dtype == np.dtype("bfloat16")


def _copy(tmp_path: Path, name: str = "dense_first_t5") -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def _rewrite(d: Path, edit) -> None:
    reader = SafetensorsReader(d)
    tensors = {n: np.array(reader.get(n)) for n in reader.names()}
    del reader
    edit(tensors)
    (d / "model.safetensors").unlink()
    write(d, iter(tensors.items()), max_shard_bytes=1 << 30)


def test_bad_checkpoints_fail_naming_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "nope")
    d = _copy(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_model(d)

    d = _copy(tmp_path / "a")
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing 1: model.layers.1.mlp.experts.2.up_proj"):
        load_model(d)

    d = _copy(tmp_path / "b")
    _rewrite(d, lambda t: t.update({"model.layers.9.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ConfigError, match=r"unexpected 1: model.layers.9.extra.weight"):
        load_model(d)

    d = _copy(tmp_path / "c")
    _rewrite(d, lambda t: t.update({"model.norm.weight": np.zeros(31, np.float32)}))
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \(31,\); .* \(32,\)"):
        load_model(d)

    d = _copy(tmp_path / "c2")
    _rewrite(d, lambda t: t.update({"model.norm.weight": np.zeros(32, np.int32)}))
    with pytest.raises(ConfigError, match=r"model.norm.weight has dtype int32; expected one of"):
        load_model(d)

    d = _copy(tmp_path / "d", "sparse_step_released")
    (d / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(ConfigError, match="names shard model-00002-of-00005.safetensors"):
        load_model(d)

    d = _copy(tmp_path / "e")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    with pytest.raises(ConfigError, match="attention_bias=True is not supported"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama'"):
        load_model(d)


def test_safetensors_round_trip_is_bit_exact_across_shards(tmp_path):
    reader = SafetensorsReader(FIXTURES / "sparse_step_released")
    files = write(tmp_path, ((n, reader.get(n)) for n in reader.names()), max_shard_bytes=30_000)
    assert (tmp_path / "model.safetensors.index.json") in files and len(files) > 3
    back = SafetensorsReader(tmp_path)
    assert back.names() == reader.names()
    for n in reader.names():
        a, b = np.asarray(reader.get(n)), np.asarray(back.get(n))
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), n
