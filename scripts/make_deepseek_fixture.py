"""Writes the DeepSeek-V3 fixtures of tests/convert/ (run by hand, not by CI; called by
scripts/make_hf_fixture.py, also runnable alone with the same venv):

    /tmp/hfvenv/bin/python scripts/make_deepseek_fixture.py [--out tests/fixtures/hf]

`deepseek_v3_t5/`: a tiny random DeepseekV3ForCausalLM saved by transformers 5 (float32,
config.json as transformers writes it: rope_parameters, dtype) with every feature of the
architecture on: the query's low-rank path (q_lora_rank), YaRN with mscale != mscale_all_dim
(so both the cos/sin factor and the softmax-scale fold differ from 1), interleaved RoPE, a
dense first layer, group-limited routing (4 groups of 2, the best 2 groups) with a non-zero
e_score_correction_bias, one shared expert, routed_scaling_factor 2.5. transformers builds no
MTP module, so its layer (`model.layers.3.*`: a full MoE decoder layer plus enorm, hnorm,
eh_proj, shared_head.norm and the copies of embed_tokens and shared_head.head that released
checkpoints store) is added to the safetensors with random weights; transformers ignores it.

`deepseek_v3_fp8/`: the same weights as DeepSeek releases them: every attention, dense-MLP,
expert, shared-expert and eh_proj weight block-scaled float8_e4m3fn with a float32
weight_scale_inv in 4 x 6 blocks (several per tensor, partial ones at the edges), everything
else bfloat16 but the float32 e_score_correction_bias; two shards with an index; config.json in
the released spelling (rope_scaling type yarn, rope_theta, torch_dtype, topk_method,
scoring_func, moe_layer_freq, quantization_config). Its logits are transformers' (float32) on
the dequantized weights.

`deepseek_v3_moonlight/`: Moonlight-16B-A3B's variant of the architecture: no query low-rank
path (q_lora_rank null: one q_proj), plain RoPE, two shared experts, no expert groups,
rms_norm_eps 1e-5, no MTP layer; float32, config.json in the released spelling.

Each has input_ids.npy [2, 12] (int32) and logits.npy [2, 12, V] (float32, eager attention).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

CONFIG: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rope_interleave=True,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.8,
        mscale_all_dim=1.0,
    ),
    tie_word_embeddings=False,
)
# Moonlight-16B-A3B's variant: no query low-rank path (q_proj), plain RoPE, two shared experts,
# no expert groups, rms_norm_eps 1e-5, no MTP layer; released spelling, float32.
MOONLIGHT: dict[str, Any] = {
    **CONFIG,
    "num_hidden_layers": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": None,
    "rms_norm_eps": 1e-5,
    "routed_scaling_factor": 2.446,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    "num_nextn_predict_layers": 0,
}
BLOCK = (4, 6)
# What DeepSeek's releases store as FP8 (the rest: embedding, head, norms, router, bias).
QUANTIZED = (
    ".self_attn.q_a_proj.weight",
    ".self_attn.q_b_proj.weight",
    ".self_attn.q_proj.weight",
    ".self_attn.kv_a_proj_with_mqa.weight",
    ".self_attn.kv_b_proj.weight",
    ".self_attn.o_proj.weight",
    ".mlp.gate_proj.weight",
    ".mlp.up_proj.weight",
    ".mlp.down_proj.weight",
    ".eh_proj.weight",
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random init is ~N(0, 0.02): scale up so routing and logits are far from uniform; norms
    near 1; the routers' selection bias in +-0.2, enough to change which experts win."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(10.0)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.empty_like(b).uniform_(-0.2, 0.2))


def _saved(model: DeepseekV3ForCausalLM, d: Path) -> dict[str, torch.Tensor]:
    """The tensors transformers writes for `model` (per-expert names, as checkpoints store)."""
    model.save_pretrained(d)
    return load_file(d / "model.safetensors")


def _mtp_layer(cfg: dict, main: dict[str, torch.Tensor], tmp: Path) -> dict[str, torch.Tensor]:
    """Random MTP weights named as DeepSeek-V3's released layer 61 (here layer L = 3)."""
    n = cfg["num_hidden_layers"]
    longer = DeepseekV3ForCausalLM(DeepseekV3Config(**{**cfg, "num_hidden_layers": n + 1}))
    _randomize(longer, 61)
    prefix = f"model.layers.{n}."
    out = {k: v for k, v in _saved(longer, tmp / "longer").items() if k.startswith(prefix)}
    g = torch.Generator().manual_seed(62)
    d = cfg["hidden_size"]
    out[prefix + "enorm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    out[prefix + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    out[prefix + "eh_proj.weight"] = 0.2 * torch.randn(d, 2 * d, generator=g)
    out[prefix + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    out[prefix + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    out[prefix + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    return out


def _logits(model: DeepseekV3ForCausalLM, ids: np.ndarray) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


def _write(d: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file(
            {k: tensors[k].contiguous() for k in names}, d / "model.safetensors", {"format": "pt"}
        )
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k].contiguous() for k in part}, d / file, {"format": "pt"})
        weight_map.update({k: file for k in part})
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization: scale = amax / 448 per BLOCK; (fp8 w / scale, scale)."""
    br, bc = BLOCK
    rows, cols = w.shape
    grid = (-(-rows // br), -(-cols // bc))
    s = torch.ones(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max()
            s[i, j] = torch.clamp(amax, min=1e-12) / 448.0
    full = s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    br, bc = BLOCK
    rows, cols = q.shape
    full = s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.to(torch.float32) * full


def released_spelling(cfg: dict, quantized: bool = True) -> dict:
    """config.json as DeepSeek-V3's release spells it (transformers 4.33 + remote code)."""
    cfg = dict(cfg)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = {"type": kind, **rope} if kind != "default" else None
    cfg["torch_dtype"] = "bfloat16" if quantized else cfg["dtype"]
    cfg.pop("dtype", None)
    for key in ("head_dim", "qk_head_dim", "rope_interleave", "output_router_logits"):
        cfg.pop(key, None)
    cfg.update(
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
        aux_loss_alpha=0.001,
        seq_aux=True,
        ep_size=1,
    )
    if quantized:
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(BLOCK),
        }
    return dict(sorted(cfg.items()))


def _fresh(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():
        f.unlink()
    return d


def make_moonlight_style(out: Path, ids: np.ndarray) -> None:
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**MOONLIGHT, attn_implementation="eager"))
    _randomize(model, 16)
    d = _fresh(out / "deepseek_v3_moonlight")
    with tempfile.TemporaryDirectory() as tmp:
        tensors = _saved(model, Path(tmp))
        cfg_json = json.loads((Path(tmp) / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(released_spelling(cfg_json, False), indent=2) + "\n")
    _write(d, tensors)
    np.save(d / "input_ids.npy", ids)
    np.save(d / "logits.npy", _logits(model, ids).astype(np.float32))
    _report(d)


def make_deepseek_fixtures(out: Path) -> None:
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(2, 12)).astype(np.int32)
    make_moonlight_style(out, ids)
    torch.manual_seed(30)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG, attn_implementation="eager"))
    _randomize(model, 30)
    with tempfile.TemporaryDirectory() as tmp:
        main = _saved(model, Path(tmp) / "main")
        cfg_json = json.loads((Path(tmp) / "main" / "config.json").read_text())
        tensors = {**main, **_mtp_layer(CONFIG, main, Path(tmp))}

        d = _fresh(out / "deepseek_v3_t5")
        (d / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
        _write(d, tensors)
        np.save(d / "input_ids.npy", ids)
        np.save(d / "logits.npy", _logits(model, ids).astype(np.float32))
        _report(d)

        # The FP8 twin and the float32 weights transformers runs for its logits.
        stored, dequantized = {}, {}
        for name, w in tensors.items():
            if name.endswith(QUANTIZED) or ".mlp.experts." in name:
                q, s = quantize(w)
                stored[name], stored[name + "_scale_inv"] = q, s
                dequantized[name] = dequantize(q, s)
            elif name.endswith("e_score_correction_bias"):
                stored[name] = dequantized[name] = w.float()
            else:
                stored[name] = w.to(torch.bfloat16)
                dequantized[name] = stored[name].float()
        ref_dir = Path(tmp) / "dequantized"
        ref_dir.mkdir()
        (ref_dir / "config.json").write_text(json.dumps(cfg_json))
        n = CONFIG["num_hidden_layers"]
        main_only = {k: v for k, v in dequantized.items() if not k.startswith(f"model.layers.{n}.")}
        _write(ref_dir, main_only)
        ref = DeepseekV3ForCausalLM.from_pretrained(
            ref_dir, dtype=torch.float32, attn_implementation="eager"
        )

        d = _fresh(out / "deepseek_v3_fp8")
        (d / "config.json").write_text(json.dumps(released_spelling(cfg_json), indent=2) + "\n")
        _write(d, stored, shards=2)
        np.save(d / "input_ids.npy", ids)
        np.save(d / "logits.npy", _logits(ref, ids).astype(np.float32))
        _report(d)


def _report(d: Path) -> None:
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{d}: {sorted(f.name for f in d.iterdir())}, {size / 1e3:.0f} kB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/hf"))
    make_deepseek_fixtures(Path(p.parse_args().out))


if __name__ == "__main__":
    main()
