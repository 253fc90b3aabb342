"""Compiler estimates for gmm/tgmm on TPU, ahead of time: pallas_tpu vs ragged_dot.

Legend: M rows (tokens * top-k), D model dim, F expert hidden dim, E experts.

No TPU is needed: each call is compiled against a libtpu topology and the numbers printed are
the compiler's own (compiled.cost_analysis(), compiled.memory_analysis()). They are estimates,
not measurements. For a Pallas kernel the flops and bytes come from the kernel's
pl.CostEstimate (the compiler cannot see inside Mosaic), for ragged_dot from XLA's analysis,
so compare memory footprints directly and read the cost columns with that in mind.

    python scripts/bench_gmm_aot.py                       # v5p and tpu7x, Qwen3-30B-A3B
    python scripts/bench_gmm.py --tpu-aot                 # the same, via the main bench
    python scripts/bench_gmm_aot.py --d-model 4096 --d-ff 1536 --chips v6e   # Qwen3-235B-A22B
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext.aot import TOPOLOGY_BY_CHIP, tpu_devices
from moetext.kernels.gmm import GmmCall, get_backend
from moetext.kernels.gmm.pallas_tpu import PallasTpuBackend

DEFAULTS: dict[str, Any] = dict(
    chips=("v5p", "tpu7x"), rows=8192 * 8, d_model=2048, d_ff=768, experts=128
)


def add_args(parser: argparse.ArgumentParser) -> None:
    """The options run_tpu_aot reads (bench_gmm.py adds them to its --tpu-aot parser).

    Defaults: Qwen3-30B-A3B experts, 8192 tokens routed to top-8 on v5p and tpu7x.
    """
    parser.add_argument(
        "--chips", nargs="+", default=list(DEFAULTS["chips"]), choices=sorted(TOPOLOGY_BY_CHIP)
    )
    parser.add_argument("--rows", type=int, default=DEFAULTS["rows"], help="M: tokens * top-k")
    parser.add_argument("--d-model", type=int, default=DEFAULTS["d_model"], help="D")
    parser.add_argument("--d-ff", type=int, default=DEFAULTS["d_ff"], help="F, per expert")
    parser.add_argument("--experts", type=int, default=DEFAULTS["experts"], help="E")


def _calls(backend, m: int, d: int, f: int, e: int):
    """gate projection x[M, D] @ w[E, D, F], its dlhs (gmm, rhs transposed) and drhs (tgmm)."""
    fwd = GmmCall(jnp.dtype(jnp.bfloat16), jnp.int32(0))
    dlhs, drhs = fwd.replace(transpose_rhs=True), fwd.replace(num_groups=e)
    return {
        "gmm fwd": (
            lambda x, w, gs: backend.gmm(x, w, gs, fwd),
            ((m, d), (e, d, f), (e,)),
        ),
        "gmm dlhs": (
            lambda dy, w, gs: backend.gmm(dy, w, gs, dlhs),
            ((m, f), (e, d, f), (e,)),
        ),
        "tgmm drhs": (
            lambda x, dy, gs: backend.tgmm(x, dy, gs, drhs),
            ((m, d), (m, f), (e,)),
        ),
    }


def _compile(fn, shapes, device):
    sharding = SingleDeviceSharding(device)
    args = [
        jax.ShapeDtypeStruct(s, jnp.int32 if len(s) == 1 else jnp.bfloat16, sharding=sharding)
        for s in shapes
    ]
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _row(chip, op, name, compiled, seconds, ideal_flops) -> str:
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax returns one dict per program
        cost = cost[0] if cost else {}
    mem = compiled.memory_analysis()
    gib = lambda b: f"{b / 2**30:7.3f}"
    flops = cost.get("flops", float("nan"))
    return (
        f"{chip:6} {op:10} {name:11} {flops / 1e9:10.1f} {flops / ideal_flops:6.2f} "
        f"{cost.get('bytes accessed', float('nan')) / 2**30:9.3f} "
        f"{gib(mem.argument_size_in_bytes)} {gib(mem.output_size_in_bytes)} "
        f"{gib(mem.temp_size_in_bytes)} {seconds:6.1f}"
    )


def run_tpu_aot(args: argparse.Namespace | None = None) -> list[str]:
    """Prints (and returns) one row per chip x call x backend."""
    opts = {
        **DEFAULTS,
        **{
            k: v
            for k, v in vars(args or argparse.Namespace()).items()
            if k in DEFAULTS and v is not None
        },
    }
    m, d, f, e = opts["rows"], opts["d_model"], opts["d_ff"], opts["experts"]
    lines = [
        f"TPU AOT compiler estimates (not measurements): M={m} D={d} F={f} E={e} bf16, "
        f"default tiling; jax {jax.__version__}",
        f"{'chip':6} {'call':10} {'backend':11} {'GFLOP':>10} {'/ideal':>6} {'GiB acc.':>9} "
        f"{'arg GiB':>7} {'out GiB':>7} {'tmp GiB':>7} {'cmp s':>6}",
    ]
    print(*lines, sep="\n", flush=True)
    ideal = 2.0 * m * d * f  # each row meets exactly one expert's D x F weights
    for chip in opts["chips"]:
        device = tpu_devices(TOPOLOGY_BY_CHIP[chip])[0]
        backends = {
            "pallas_tpu": PallasTpuBackend(interpret=False, chip=chip),
            "ragged_dot": get_backend("ragged_dot"),
        }
        for op in ("gmm fwd", "gmm dlhs", "tgmm drhs"):
            for name, backend in backends.items():
                fn, shapes = _calls(backend, m, d, f, e)[op]
                compiled, seconds = _compile(fn, shapes, device)
                lines.append(_row(chip, op, name, compiled, seconds, ideal))
                print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    run_tpu_aot(parser.parse_args())
