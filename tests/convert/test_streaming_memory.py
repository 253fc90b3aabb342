"""hf-to-orbax streams: converting a checkpoint 4x larger than the allowed growth of anonymous
memory (RssAnon: memory-mapped file pages do not count) stays within it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from moetext.convert.safetensors_io import SafetensorsReader, write
from moetext.models.qwen3_moe.hf import config_from_hf, tensor_map

REPO = Path(__file__).resolve().parents[2]
# Measured 45-56 MB (docs/convert.md): the writer's in-flight bound (32 MiB) plus the
# allocator's and tensorstore's working set; 70 MB leaves room for a loaded machine.
ALLOWED_GROWTH = 70 * 10**6
# 8 layers of 64 experts (bf16, [512, 256] each): 407 MB in 6 files of <= 100 MB.
HF_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def _make_checkpoint(d: Path) -> int:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    model, moe, _ = config_from_hf(HF_CONFIG)
    rng = np.random.default_rng(0)

    def tensors():
        for t in tensor_map(model, moe):
            for name in t.hf_names:
                x = rng.standard_normal(t.hf_shape, np.float32)
                yield name, x.astype(ml_dtypes.bfloat16)

    files = write(d, tensors(), max_shard_bytes=100 * 10**6)
    return sum(f.stat().st_size for f in files)


def _rss_anon(pid: int) -> int | None:
    """The process's anonymous resident memory; None once it has exited (a zombie has none)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in lines:
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return None


def test_peak_anonymous_memory_stays_below_a_quarter_of_the_checkpoint(tmp_path):
    size = _make_checkpoint(tmp_path / "hf")
    assert size > 4 * ALLOWED_GROWTH, size
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'src'}"}
    cmd = [sys.executable, "-m", "tests.convert.memory_worker", str(tmp_path / "hf")]
    proc = subprocess.Popen(
        [*cmd, str(tmp_path / "out")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "READY"
        base = _rss_anon(proc.pid)
        assert base is not None
        peak = base
        proc.stdin.write("\n")
        proc.stdin.flush()
        while proc.poll() is None and (now := _rss_anon(proc.pid)) is not None:
            peak = max(peak, now)
            time.sleep(0.002)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "DONE" in out, err
    growth = peak - base
    print(f"checkpoint {size / 1e6:.0f} MB, RssAnon growth {growth / 1e6:.1f} MB")
    assert growth < ALLOWED_GROWTH, f"{growth / 1e6:.0f} MB"
    # And it converted: a few tensors read back equal (the full check is in test_roundtrip).
    reader = SafetensorsReader(tmp_path / "hf")
    w = np.asarray(reader.get("model.layers.7.mlp.experts.63.down_proj.weight"))
    import orbax.checkpoint as ocp

    item = {"params": {"layers": {"7": {"mlp": {"experts": {"w_down": {"value": 0}}}}}}}
    args = {
        "params": {
            "layers": {
                "7": {
                    "mlp": {
                        "experts": {"w_down": {"value": ocp.RestoreArgs(restore_type=np.ndarray)}}
                    }
                }
            }
        }
    }
    got = ocp.PyTreeCheckpointer().restore(
        tmp_path / "out" / "state",
        args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True),
    )["params"]["layers"]["7"]["mlp"]["experts"]["w_down"]["value"]
    assert got.dtype == w.dtype and np.array_equal(got[63], w.T)
