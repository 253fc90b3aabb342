"""Decode step time: the training MoE layer vs prefused gate|up (grouped) vs the decode path
(gathered routed experts), at several batch sizes, in one process.

    .venv/bin/python scripts/bench_decode.py [--shapes tiny,30b-2layer] [--batches 1,8,64]
        [--steps 64] [--repeats 3] [--out bench.json]
        [--aot v5e:2x4,v6e:2x2 --shapes "" [--aot_preset fsdp_ep --aot_set sharding.mesh.expert=4]
         [--aot_batches 1,8,64] [--aot_decode_moe fused,loop] [--cost]]

A decode step is one new token for every row of the batch (KV cache, jitted while_loop). Time
per step = (best of --repeats generate calls with 1 + steps new tokens - best of --repeats with
1 new token) / steps, after a compile run of each; prompts are 8 random tokens (one 32-slot bucket).
--aot compiles the Qwen3-30B-A3B decode step for each topology, batch (--aot_batches, default
--aot_batch) and kernels.decode_moe (--aot_decode_moe; default the config's, auto); --cost adds
the step-cost walk (moetext.step_cost.decode_step_cost: compiled FLOPs, HBM bytes, interconnect
bytes, roofline step time; compiler-derived estimates, not timings) and prints a table.
Shapes: `tiny` is configs/models/tiny-qwen3-moe.yml; `30b-2layer` is Qwen3-30B-A3B
(configs/models/qwen3-30b-a3b.yml) cut to 2 MoE layers, bf16 params and compute.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

import jax  # isort: skip
import numpy as np
from flax import nnx

from moetext import config as config_lib
from moetext import models
from moetext.generate import decode
from moetext.generate.decode import generate_ids
from moetext.models.moe import decode as moe_decode

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": (REPO / "configs/models/tiny-qwen3-moe.yml", []),
    "30b-2layer": (
        REPO / "configs/models/qwen3-30b-a3b.yml",
        ["model.num_layers=2", "model.param_dtype=bfloat16", "model.scan_layers=false"],
    ),
}
NEVER = 10**9  # no EOS: every row decodes every step


def build(shape: str, prefused: bool) -> tuple[Any, int]:
    path, overrides = SHAPES[shape]
    cfg = config_lib.load(path, [*overrides, "model.scan_layers=false"])
    model = models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    if prefused:
        moe_decode.prefuse_all(model)
    return model, cfg.model.vocab_size


def step_ms(model: Any, vocab: int, batch: int, steps: int, repeats: int) -> float:
    prompts = np.random.default_rng(0).integers(0, vocab, (batch, 8)).tolist()

    def timed(new: int) -> float:
        t0 = time.perf_counter()
        generate_ids(model, prompts, max_new_tokens=new, eos_id=NEVER)
        return time.perf_counter() - t0

    timed(1), timed(1 + steps)  # compile both
    long = min(timed(1 + steps) for _ in range(repeats))
    short = min(timed(1) for _ in range(repeats))
    return 1000 * (long - short) / steps


def cost_table(reports: list[dict[str, Any]]) -> str:
    """A Markdown table of --aot --cost reports, one row per compile."""
    head = (
        "| topology | batch | decode_moe | layers | memory / device GiB | FLOPs / device | "
        "HBM bytes / device | ICI bytes / device | roofline step (ms) | dominant |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in reports:
        c = r["cost"]
        lines.append(
            f"| {r['topology']} | {r['batch']} | {r['decode_moe']} | {r['num_layers']} | "
            f"{r['total_bytes'] / 2**30:.2f} | {c['compiled_flops']:.3g} | "
            f"{c['hbm_bytes_accessed'] / 1e9:.3f} GB | {c['ici_bytes'] / 1e6:.2f} MB | "
            f"{c['step_s_low'] * 1e3:.3f} - {c['step_s_high'] * 1e3:.3f} | {c['dominant']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="tiny,30b-2layer")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    p.add_argument(
        "--aot",
        default="",
        help="comma-separated TPU topologies (e.g. v5e:2x4,v6e:2x2): AOT-compile the "
        "qwen3-30b-a3b decode step (bf16 params, --aot_batch rows, --aot_cache slots) for each",
    )
    p.add_argument("--aot_batch", type=int, default=8)
    p.add_argument("--aot_batches", default="", help="comma-separated batches (overrides)")
    p.add_argument("--aot_decode_moe", default="", help="comma-separated kernels.decode_moe values")
    p.add_argument("--cost", action="store_true", help="add the step-cost report to --aot")
    p.add_argument("--aot_cache", type=int, default=4096)
    p.add_argument("--aot_preset", default="fsdp")
    p.add_argument(
        "--aot_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config overrides for the AOT compile, e.g. sharding.mesh.expert=4",
    )
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    batches = [int(b) for b in filter(None, args.aot_batches.split(","))] or [args.aot_batch]
    kernels = [[f"kernels.decode_moe={k}"] for k in filter(None, args.aot_decode_moe.split(","))]
    for topology in filter(None, args.aot.split(",")):
        from moetext import step_cost
        from moetext.aot import compiled_decode_step, hlo_text

        for batch in batches:
            for kernel in kernels or [[]]:
                cfg = config_lib.load(
                    REPO / "configs/models/qwen3-30b-a3b.yml",
                    [
                        "model.param_dtype=bfloat16",
                        f"sharding.preset={args.aot_preset}",
                        *args.aot_set,
                        *kernel,
                    ],
                )
                r, compiled = compiled_decode_step(
                    cfg, topology, batch=batch, cache_len=args.aot_cache
                )
                if args.cost:
                    r["cost"] = step_cost.decode_step_cost(r, hlo_text(compiled))
                print(json.dumps({"aot": r}), flush=True)
                rows.append({"aot": r})
    if args.cost:
        print(cost_table([r["aot"] for r in rows if "aot" in r]), flush=True)
    if not args.shapes:
        return
    for shape in filter(None, args.shapes.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            result: dict[str, Any] = {"shape": shape, "batch": batch}
            # unfused: the training layer; prefused: grouped gate|up (no gather); decode: as
            # moetext.generate runs (gathered while batch * top_k <= num_experts / 8).
            for mode, prefused, gather_rows in (
                ("unfused", False, None),
                ("prefused", True, 0),
                ("decode_path", True, None),
            ):
                model, vocab = build(shape, prefused)
                saved = moe_decode.GATHER_BELOW
                moe_decode.GATHER_BELOW = gather_rows
                decode._compiled.cache_clear()  # the path is chosen when the step is traced
                try:
                    ms = step_ms(model, vocab, batch, args.steps, args.repeats)
                finally:
                    moe_decode.GATHER_BELOW = saved
                result[f"{mode}_ms"] = ms
                result[f"{mode}_tokens_per_s"] = 1000 * batch / ms
                del model
            result["decode_path_speedup_vs_unfused"] = (
                result["unfused_ms"] / result["decode_path_ms"]
            )
            result["prefused_speedup_vs_unfused"] = result["unfused_ms"] / result["prefused_ms"]
            print(json.dumps(result), flush=True)
            rows.append(result)
    meta = {"device": jax.devices()[0].device_kind, "steps": args.steps, "repeats": args.repeats}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
