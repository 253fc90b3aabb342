"""scripts/aot_compile.py: the real train step compiles for a TPU topology (libtpu, no TPU).

One compile of a 2-layer Qwen3-30B-A3B-shaped model (full widths, 128 experts) on v5p:2x2x1.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@pytest.fixture(scope="module")
def aot():
    spec = importlib.util.spec_from_file_location("aot_compile", REPO / "scripts/aot_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HLO = """\
HloModule jit_step

%body.1 (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %ag = bf16[32,16]{1,0} all-gather(bf16[8,16]{1,0} %x), replica_groups={}, dimensions={0}
  %ar-start = f32[4]{0} all-reduce-start(f32[4]{0} %y), to_apply=%add
  %ar-done = f32[4]{0} all-reduce-done(f32[4]{0} %ar-start)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], bf16[8,16]) while((s32[], bf16[8,16]) %t), condition=%cond.1, body=%body.1, \
backend_config={"known_trip_count":{"n":"48"}}
  %rs = f32[2,3]{1,0} reduce-scatter(f32[8,3]{1,0} %z), dimensions={0}
  %a2a = (bf16[4,2]{1,0}, bf16[4,2]{1,0}) all-to-all(bf16[4,2] %p, bf16[4,2] %q)
  %rag = bf16[64,8]{1,0} ragged-all-to-all(bf16[16,8]{1,0} %r, bf16[64,8]{1,0} %o, s32[4] %i)
  %q8 = f8e4m3fn[128,2048,768]{2,1,0} all-gather(f8e4m3fn[128,64,768]{2,1,0} %w), dimensions={1}
}
"""


def test_collective_parser_counts_scan_bodies_per_trip(aot):
    got = aot.collectives(HLO)
    assert got[("all-gather", "bf16")] == {"count": 48, "bytes": 48 * 32 * 16 * 2}
    assert got[("all-reduce", "f32")] == {"count": 48, "bytes": 48 * 4 * 4}
    assert got[("reduce-scatter", "f32")] == {"count": 1, "bytes": 2 * 3 * 4}
    assert got[("all-to-all", "bf16")] == {"count": 1, "bytes": 2 * 4 * 2 * 2}
    assert got[("ragged-all-to-all", "bf16")] == {"count": 1, "bytes": 64 * 8 * 2}
    assert got[("all-gather", "f8e4m3fn")] == {"count": 1, "bytes": 128 * 2048 * 768}
    assert len(got) == 6  # the -done half of an async pair is not counted again
    shapes = aot.collectives(HLO, by="shape")
    assert shapes[("all-gather", "f8e4m3fn[128,2048,768]")]["count"] == 1
    assert shapes[("all-gather", "bf16[32,16]")]["count"] == 48


def test_unknown_generation_is_an_error(aot):
    with pytest.raises(SystemExit, match="unknown TPU generation 'v9z'"):
        aot.hbm_bytes("v9z:2x2")


def test_qwen3_30b_shape_compiles_for_v5p_and_reports(aot, tmp_path, monkeypatch):
    out = tmp_path / "aot.json"
    # A chip with 1 MiB of HBM: the step cannot fit, so main() must exit non-zero.
    monkeypatch.setitem(aot.HBM_GIB, "v5p", 1 / 1024)
    rc = aot.main(
        [
            str(REPO / "configs/models/qwen3-30b-a3b.yml"),
            "topology=v5p:2x2x1",
            "model.num_layers=2",
            "data.global_batch_size=4",
            "data.seq_len=128",
            "kernels.gmm_backend=ragged_dot",
            "sharding.preset=fsdp",
            f"json={out}",
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 1 and r["fits"] is False
    assert r["chips"] == 4 and r["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
    # Arguments: f32 params + two f32 Adam moments, sharded 4 ways. 2 layers of
    # Qwen3-30B-A3B + embeddings ~ 1.88e9 params -> ~5.6 GB per chip; allow 10% for the rest.
    params = 2 * 151936 * 2048 + 2 * (
        2048 * (32 + 4 + 4) * 128 + 32 * 128 * 2048 + 3 * 128 * 2048 * 768 + 2048 * 128
    )
    expect = params * 12 / 4
    assert 0.9 * expect <= r["arguments_bytes"] <= 1.1 * expect, (r["arguments_bytes"], expect)
    assert r["temporaries_bytes"] > 0 and r["xla_flops_per_chip"] > 0
    assert r["model_flops_per_chip"] > 0
    assert r["total_bytes"] < 95 * 1024**3  # fits a real v5p chip comfortably
    ops = {c["op"] for c in r["collectives"]}
    assert "all-gather" in ops, r["collectives"]  # FSDP gathers the sharded weights
