"""Hugging Face DeepSeek-V3 checkpoints in moetext (no torch: fixtures made by
scripts/make_deepseek_fixture.py with transformers 5.23): float32 logits equal transformers',
for the float32 checkpoint and for its block-scaled FP8 twin; hf -> orbax -> hf is bit-exact;
the FP8 weights convert to the float64 oracle's values; the MTP layer and the routers'
selection bias travel; bad checkpoints fail in one line naming the tensor."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from moetext import models
from moetext.checkpoint import LeafReader
from moetext.config.schema import KernelsConfig
from moetext.convert.hf import load_model
from moetext.convert.hf_to_orbax import hf_to_orbax
from moetext.convert.orbax_to_hf import orbax_to_hf
from moetext.convert.safetensors_io import SafetensorsReader, write
from moetext.errors import ConfigError
from moetext.models.deepseek_v3.config import deepseek_model
from moetext.models.deepseek_v3.hf import config_from_hf

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "hf"
T5, FP8 = FIXTURES / "deepseek_v3_t5", FIXTURES / "deepseek_v3_fp8"
MOON = FIXTURES / "deepseek_v3_moonlight"  # q_lora_rank null, plain RoPE, 2 shared experts
BLOCK = (4, 6)  # the FP8 fixture's quantization_config.weight_block_size
MTP = "model.layers.3."  # the fixture's MTP layer (num_hidden_layers = 3)
REFERENCE = KernelsConfig(gmm_backend="reference")


def _tensors(d: Path) -> dict[str, np.ndarray]:
    r = SafetensorsReader(d)
    return {n: np.asarray(r.get(n)) for n in r.names()}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("d", [T5, FP8, MOON], ids=["float32", "fp8_block_scaled", "moonlight"])
def test_float32_logits_match_transformers(d):
    cfg, model = load_model(d, dtype="float32", kernels=REFERENCE)
    assert cfg.model.family == "deepseek_v3"
    ids = np.load(d / "input_ids.npy")
    want = np.load(d / "logits.npy")  # the FP8 twin's: transformers on the dequantized weights
    got = np.asarray(jax.jit(lambda t: model(t)[0])(ids))
    assert got.shape == want.shape and got.dtype == np.float32
    # Both float32, different summation orders: 1e-4 on logits of magnitude ~5 is ~2e-5
    # relative, far below a mapping error (a transposed kv_b or a missing YaRN fold moves
    # logits by O(1); a router picking another expert by ~0.1). Measured: 6.9e-6 (float32),
    # 4.5e-6 (FP8), 3.3e-6 (moonlight, whose rms_norm_eps 1e-5 MLA's q_a/kv_a norms do not
    # take: 1e-6 there, as in transformers; 4.0e-5 when they took it).
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    p = np.exp(_log_softmax(want))
    assert (p * (_log_softmax(want) - _log_softmax(got))).sum(-1).mean() <= 1e-6


def test_selection_bias_and_mtp_layer_are_the_hf_tensors():
    cfg, model = load_model(T5, kernels=REFERENCE)
    hf = _tensors(T5)
    routers = [model.layers[1].mlp.router, model.layers[2].mlp.router]  # layer 0 is dense
    routers.append(model.mtp.depths[0].layer.mlp.router)  # the MTP layer: HF layer 3
    for i, router in zip((1, 2, 3), routers, strict=True):
        bias = hf[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert np.abs(bias).max() > 0.05  # the fixture's bias is non-zero
        np.testing.assert_array_equal(router.selection_bias[...], bias)
    assert deepseek_model(cfg.model).mtp_layers == 1
    depth = model.mtp.depths[0]
    # eh_proj: HF [D, 2D] (out, in) is moetext's [2D, D] transposed, the embedding's rows first.
    np.testing.assert_array_equal(depth.eh_proj[...], hf[f"{MTP}eh_proj.weight"].T)
    np.testing.assert_array_equal(depth.enorm.scale[...], hf[f"{MTP}enorm.weight"])
    np.testing.assert_array_equal(depth.hnorm.scale[...], hf[f"{MTP}hnorm.weight"])
    np.testing.assert_array_equal(
        depth.shared_head.norm.scale[...], hf[f"{MTP}shared_head.norm.weight"]
    )


@pytest.mark.parametrize("src", [T5, MOON], ids=["t5", "moonlight"])
def test_hf_orbax_hf_is_bit_exact(tmp_path, capsys, src):
    cfg = hf_to_orbax(src, tmp_path / "ckpt")
    files = orbax_to_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=100_000)
    assert files[-1].name == "model.safetensors.index.json"
    a, b = _tensors(src), _tensors(tmp_path / "hf")
    mtp = sorted(n for n in a if n.startswith(MTP))
    m = deepseek_model(cfg.model)
    if src == MOON:
        assert not mtp and m.mtp_layers == 0 and m.q_lora_rank is None
    else:  # the MTP layer, its copies of the embedding and head included, travels both ways
        assert len(mtp) > 20 and f"{MTP}embed_tokens.weight" in mtp and m.mtp_layers == 1
    assert "warning: config.json" not in capsys.readouterr().err
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert a[n].tobytes() == b[n].tobytes(), n
    state = LeafReader(tmp_path / "ckpt", item="model_state")
    bias = state.get(("layers", 1, "mlp", "router", "selection_bias"))
    np.testing.assert_array_equal(bias, a["model.layers.1.mlp.gate.e_score_correction_bias"])
    src_cfg = json.loads((src / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "rope_scaling" in out_cfg and "torch_dtype" in out_cfg  # the released spelling
    assert config_from_hf(out_cfg) == config_from_hf(src_cfg)


def _oracle(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """float64 W[r, c] * S[r // br, c // bc]."""
    r = np.arange(w.shape[0])[:, None] // BLOCK[0]
    c = np.arange(w.shape[1])[None, :] // BLOCK[1]
    return w.astype(np.float64) * s.astype(np.float64)[r, c]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_weights_convert_to_the_float64_oracle(tmp_path, dtype):
    # hf-to-orbax dequantizes (default dtype: config.json's torch_dtype, bfloat16), orbax-to-hf
    # writes plain weights: each the oracle rounded once to the dtype.
    hf_to_orbax(FP8, tmp_path / "ckpt", dtype=None if dtype == "bfloat16" else dtype)
    orbax_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    src, out = _tensors(FP8), _tensors(tmp_path / "hf")
    scaled = [n for n in src if n + "_scale_inv" in src]
    assert len(scaled) > 40 and f"{MTP}eh_proj.weight" in scaled
    assert not any(n.endswith("_scale_inv") for n in out)
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    for n in scaled:
        assert src[n].dtype == ml_dtypes.float8_e4m3fn
        want = _oracle(src[n], src[n + "_scale_inv"]).astype(np.float32).astype(target)
        assert out[n].dtype == target
        np.testing.assert_array_equal(out[n], want, err_msg=n)
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert src[n].dtype == ml_dtypes.bfloat16  # stored high precision, never scaled
        np.testing.assert_array_equal(out[n].astype(np.float32), src[n].astype(np.float32))
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert out[bias].dtype == np.float32
    np.testing.assert_array_equal(out[bias], src[bias])


def _copy(tmp_path: Path, edit_tensors=None, edit_config=None) -> Path:
    d = tmp_path / "broken"
    shutil.copytree(FP8, d)
    if edit_tensors is not None:
        tensors = _tensors(d)
        edit_tensors(tensors)
        for f in d.glob("model*"):
            f.unlink()
        write(d, iter(sorted(tensors.items())), max_shard_bytes=1 << 30)
    if edit_config is not None:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_bad_fp8_checkpoints_fail_naming_the_tensor(tmp_path):
    scale = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    d = _copy(tmp_path, edit_tensors=lambda t: t.pop(scale))
    with pytest.raises(
        ConfigError,
        match=r"tensor model\.layers\.1\.self_attn\.kv_b_proj\.weight is float8_e4m3fn but the "
        r"checkpoint has no model\.layers\.1\.self_attn\.kv_b_proj\.weight_scale_inv",
    ):
        load_model(d)
    shutil.rmtree(d)

    def block(cfg):
        cfg["quantization_config"]["weight_block_size"] = [8, 6]

    d = _copy(tmp_path, edit_config=block)
    with pytest.raises(
        ConfigError,
        match=r"^tensor model\.layers\.\d.*_scale_inv has shape \(\d+, \d+\); .* in 8 x 6",
    ):
        load_model(d)
    shutil.rmtree(d)

    def method(cfg):
        cfg["quantization_config"]["quant_method"] = "awq"

    d = _copy(tmp_path, edit_config=method)
    with pytest.raises(ConfigError, match=r"quant_method='awq' is not supported; supported: fp8"):
        load_model(d)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "moetext.convert", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_cli_errors_are_one_line(tmp_path):
    d = _copy(tmp_path, edit_tensors=lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale_inv"))
    r = _cli("hf-to-orbax", "--hf", str(d), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), r.stderr  # one line
    assert "model.layers.0.mlp.up_proj.weight_scale_inv" in errors[0]
    assert not (tmp_path / "out").exists()

    next_ = tmp_path / "qwen3_next"
    next_.mkdir()
    cfg = json.loads((T5 / "config.json").read_text())
    cfg.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"])
    (next_ / "config.json").write_text(json.dumps(cfg))
    r = _cli("hf-to-orbax", "--hf", str(next_), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert (
        "model_type='qwen3_next', which no model family reads; supported: deepseek_v3 "
        "(deepseek_v3), kimi_k2 (deepseek_v3), qwen2_moe (qwen3_moe), qwen3_moe (qwen3_moe)"
    ) in r.stderr


def test_mtp_copies_must_equal_the_main_tensors(tmp_path):
    def change(t):
        t[f"{MTP}shared_head.head.weight"] = t[f"{MTP}shared_head.head.weight"] * 2

    d = tmp_path / "copy"
    shutil.copytree(T5, d)
    tensors = _tensors(d)
    change(tensors)
    (d / "model.safetensors").unlink()
    write(d, iter(sorted(tensors.items())), max_shard_bytes=1 << 30)
    with pytest.raises(ConfigError, match=rf"tensor {MTP}shared_head\.head\.weight differs from"):
        load_model(d)


def test_checkpoint_without_mtp_converts_with_mtp_off_and_a_warning(tmp_path, capsys):
    # What transformers' save_pretrained writes: num_nextn_predict_layers 1, no MTP weights.
    d = tmp_path / "no_mtp"
    shutil.copytree(T5, d)
    tensors = {n: x for n, x in _tensors(d).items() if not n.startswith(MTP)}
    (d / "model.safetensors").unlink()
    write(d, iter(sorted(tensors.items())), max_shard_bytes=1 << 30)
    cfg, _ = load_model(d, kernels=REFERENCE)
    assert cfg.model.mtp_layers == 0
    assert (
        "warning: config.json num_nextn_predict_layers=1 but the checkpoint stores no MTP layer "
        "(model.layers.3.*): converting with model.mtp_layers=0"
    ) in capsys.readouterr().err
    assert models.get_family("deepseek_v3").hf is not None


@pytest.mark.slow
def test_fine_tune_from_converted_then_export_the_scanned_run(tmp_path):
    # A run starts from the converted checkpoint (scan_layers: the dense prefix and the MoE
    # layers restacked; the MTP layer beside them), trains with MTP and the aux-loss-free bias
    # update on, and its own checkpoint exports: the HF weights, the MTP layer and every
    # e_score_correction_bias are the trained ones.
    from moetext import checkpoint, config, program, train

    converted = tmp_path / "converted"
    hf_to_orbax(T5, converted)
    run = tmp_path / "run"
    overrides = [
        f"checkpoint.load_params_from={converted}",
        "model.scan_layers=true",
        "moe.bias_update_rate=0.01",
        "optim.warmup_steps=0",
        "kernels.gmm_backend=reference",
        "data.seq_len=16",
        "data.global_batch_size=4",
        "train.steps=1",
        "train.eval_every=0",
        "train.progress_bar=false",
        "train.peak_tflops=1",
        "checkpoint.every=1",
        f"train.run_dir={run}",
    ]
    train.run(config.load(converted / "config.yml", overrides))
    orbax_to_hf(run / "checkpoints" / "1", tmp_path / "hf")
    out, start = _tensors(tmp_path / "hf"), _tensors(T5)
    assert sorted(out) == sorted(start)
    for bias in (
        "model.layers.1.mlp.gate.e_score_correction_bias",
        f"{MTP}mlp.gate.e_score_correction_bias",
    ):
        assert not np.array_equal(out[bias], start[bias])  # the update moved it
    for name in (f"{MTP}embed_tokens.weight", f"{MTP}shared_head.head.weight"):  # the copies
        main = "model.embed_tokens.weight" if "embed" in name else "lm_head.weight"
        np.testing.assert_array_equal(out[name], out[main])
    assert not np.array_equal(out[f"{MTP}eh_proj.weight"], start[f"{MTP}eh_proj.weight"])
    unscanned = config.load(converted / "config.yml", ["model.scan_layers=false"])
    plan = program.make_plan(unscanned)
    trained = checkpoint.load_params(
        str(run / "checkpoints" / "1"), unscanned, program.params_target(unscanned, plan)
    )
    _, exported = load_model(tmp_path / "hf", kernels=REFERENCE)
    want = nnx.to_pure_dict(trained)
    got = nnx.to_pure_dict(nnx.state(exported, nnx.Param))
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), got, want))
    assert not np.array_equal(out["lm_head.weight"], start["lm_head.weight"])  # it trained
