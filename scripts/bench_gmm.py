"""Grouped-matmul speed on this machine: each backend vs an equal-FLOP dense matmul.

Legend: M rows (tokens * top-k), K = D model dim, N = F expert hidden dim, G experts.

The call timed is the MoE gate projection out[M, F] = x[M, D] @ w[G, D, F] through the public
moetext.kernels.gmm.gmm, forward alone and forward + backward (dlhs and drhs via jax.vjp), under
jit, after warm-up. The baseline is x[M, D] @ w[D, F] (the same FLOPs: every row meets one D x F
matrix), forward and forward + backward, timed in alternation with the backend; each ratio is
the median over --reps (dense, backend) call pairs, so it survives a loaded machine better
than the absolute ms do. The dense matmul runs in this host's faster form for the dtype: on a
CPU without bfloat16 dot instructions its bf16 operands are widened to f32 first, as the
trainer's head does (kernels/host_dots.py; there that is the faster dense dot of the same
values, so a grouped matmul is not flattered by a slow baseline).

    python scripts/bench_gmm.py --quick                      # CPU, bf16 + f32, M=2048, G 8, 32
    python scripts/bench_gmm.py --backends blocked ragged_dot --out bench.json
    python scripts/bench_gmm.py --tpu-aot [--chips v5p ...]  # TPU compiler estimates (AOT)
    python scripts/bench_gmm.py --floor                      # memory-traffic floor per G
    python scripts/bench_gmm.py --d 1024 --f 384 --ms 32768 --gs 128   # another shape
    python scripts/bench_gmm.py --backends blocked --tm 0 512 ...  # blocked's row tile: 0 = default

--floor times, against the same dense fwd+bwd, what any grouped fwd+bwd must do besides its
FLOPs: produce the [G, D, F] weight gradient (a fresh buffer filled once) and read the
[G, D, F] weights twice (forward and dlhs). Their sum over the dense time is a lower bound on
the fwd+bwd ratio on this machine, whatever the kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext.kernels import gmm as gmm_lib
from moetext.kernels.host_dots import upcast_bf16_dots

D, F = 2048, 768  # defaults of --d / --f: Qwen3-30B-A3B's model dim and expert hidden dim
SKIP_BY_DEFAULT = ("reference", "pallas_tpu")  # float64 callback / interpret mode: not a speed
GS, BUDGET_S = [8, 32, 64, 128], 20.0
# --quick: minutes on a 2-core CPU (without it, ragged_dot's 64- and 128-expert points alone
# take tens of minutes there)
QUICK_GS, QUICK_BUDGET_S = [8, 32], 5.0


def group_sizes(m: int, g: int, routing: str, seed: int = 0) -> np.ndarray:
    """[G] int32 summing to M: equal shares (balanced), each row's expert drawn uniformly at
    random (uniform: sizes scatter around M/G, as an untrained router's do), or Dirichlet(0.3)
    expert popularity."""
    rng = np.random.default_rng(seed)
    if routing == "balanced":
        sizes = np.full(g, m // g)
        sizes[: m - sizes.sum()] += 1
    elif routing == "uniform":
        sizes = rng.multinomial(m, np.full(g, 1.0 / g))
    else:
        sizes = rng.multinomial(m, rng.dirichlet(np.full(g, 0.3)))
    return sizes.astype(np.int32)


def _once(fn, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def time_pair(fn, base, args, base_args, *, reps: int, budget_s: float) -> tuple[float, ...]:
    """(ms, dense ms, ratio, reps): medians over alternating calls of fn and the baseline.

    Alternating and taking the median of per-pair ratios keeps the ratio honest on a shared,
    loaded machine where absolute times drift by 2x within a minute. A slow fn gets fewer reps:
    as many as fit in budget_s after its first timed call, and none past that call when it
    alone takes longer (ragged_dot at 128 experts on a 2-core CPU: ~27 s a call).
    """
    for f, a in ((fn, args), (base, base_args)):
        jax.block_until_ready(f(*a))  # compile
    first = _once(fn, args)
    n = min(reps, int(budget_s / max(first, 1e-9)))
    if n < 1:  # one call alone is over the budget: that call is the only sample
        pairs, n = [(_once(base, base_args), first)], 1
    else:
        pairs = [(_once(base, base_args), _once(fn, args)) for _ in range(n)]
    dense = statistics.median(p[0] for p in pairs)
    ms = statistics.median(p[1] for p in pairs)
    ratio = statistics.median(p[1] / p[0] for p in pairs)
    return 1e3 * ms, 1e3 * dense, ratio, n


def dense_dot(a, b):
    """The equal-FLOP baseline a @ b in a's dtype, f32 accumulation, bf16 operands widened to
    f32 where this CPU has no bf16 dots (module docstring)."""
    out = a.dtype
    if upcast_bf16_dots(a.dtype):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out)


def _fwd_bwd(f):
    def run(a, b, dout):
        out, vjp = jax.vjp(f, a, b)
        return out, *vjp(dout)

    return jax.jit(run)


def bench_shape(
    m, g, routing, dtype, backends, reps, budget_s, rng, d=D, f=F, tms=(0,)
) -> list[dict]:
    D, F = d, f  # noqa: N806  (the legend's names)
    x = jnp.asarray(rng.standard_normal((m, D)), dtype)
    w_GDF = jnp.asarray(rng.standard_normal((g, D, F)) / np.sqrt(D), dtype)
    dout = jnp.asarray(rng.standard_normal((m, F)), dtype)
    gs = jnp.asarray(group_sizes(m, g, routing))
    flops = 2.0 * m * D * F
    dense_w = w_GDF[0]
    base = {
        "fwd": (jax.jit(dense_dot), (x, dense_w)),
        "fwd+bwd": (_fwd_bwd(dense_dot), (x, dense_w, dout)),
    }
    rows = []
    # blocked once per --tm row tile (0: its default), labelled blocked/tmN; others once
    runs = [(n, tm) for n in backends for tm in (tms if n == "blocked" else (0,))]
    for backend, tm in runs:
        name = f"{backend}/tm{tm}" if tm else backend

        def f(a, b, backend=backend, tm=tm):
            return gmm_lib.gmm(a, b, gs, backend=backend, tiling=(tm, 128, 128) if tm else None)

        for mode, fn, args, mult in (
            ("fwd", jax.jit(f), (x, w_GDF), 1),
            ("fwd+bwd", _fwd_bwd(f), (x, w_GDF, dout), 3),
        ):
            point = dict(
                backend=name, mode=mode, m=m, k=D, n=F, g=g, routing=routing, dtype=dtype.name
            )
            try:
                ms, dense_ms, ratio, n = time_pair(
                    fn, base[mode][0], args, base[mode][1], reps=reps, budget_s=budget_s
                )
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                # e.g. XLA:CPU's ragged_dot at M=32768, G=128 asks for ~35 GB: a result of this
                # host, not a reason to lose the other backends' rows. fwd+bwd needs more still.
                rows.append(dict(point, error=f"out of memory: {str(e).splitlines()[0]}"))
                print(f"{format_point(point)} skipped: {rows[-1]['error']}", flush=True)
                break
            point.update(
                ms=ms, reps=n, gflops=mult * flops / ms / 1e6, dense_ms=dense_ms, ratio=ratio
            )
            rows.append(point)
            print(format_row(point), flush=True)
    return rows


HEADER = (
    f"{'backend':10} {'dtype':8} {'M':>5} {'G':>4} {'routing':9} {'mode':8} {'ms':>9} "
    f"{'GFLOP/s':>8} {'dense ms':>9} {'x dense':>8}"
)


def format_point(r: dict) -> str:
    return (
        f"{r['backend']:10} {r['dtype']:8} {r['m']:>5} {r['g']:>4} {r['routing']:9} {r['mode']:8}"
    )


def format_row(r: dict) -> str:
    return (
        f"{format_point(r)} {r['ms']:9.1f} {r['gflops']:8.1f} {r['dense_ms']:9.1f} "
        f"{r['ratio']:8.2f}"
    )


def memory_floor(m: int, gs: list[int], dtype, reps: int, d: int = D, f: int = F) -> None:
    """Prints, per G, the fill + 2 reads floor of a grouped fwd+bwd over the dense fwd+bwd."""
    D, F = d, f  # noqa: N806  (the legend's names)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, D)), dtype)
    dout = jnp.asarray(rng.standard_normal((m, F)), dtype)
    dense, dense_args = _fwd_bwd(dense_dot), (x, x[:D, :F], dout)
    print(f"M={m} D={D} F={F} {jnp.dtype(dtype).name}; medians of {reps} alternating calls")
    for g in gs:
        w = jnp.asarray(rng.standard_normal((g, D, F)), dtype)
        fill = jax.jit(lambda s, g=g: jnp.full((g, D, F), s, dtype))  # drhs output alone
        read = jax.jit(lambda w: jnp.sum(w, axis=0, dtype=jnp.float32))  # one weight pass
        calls = ((dense, dense_args), (fill, (1.0,)), (read, (w,)))
        for fn, a in calls:
            jax.block_until_ready(fn(*a))
        t = [[_once(fn, a) for fn, a in calls] for _ in range(reps)]
        dt, fl, rd = (1e3 * statistics.median(r[i] for r in t) for i in range(3))
        print(
            f"G={g:4}: dense fwd+bwd {dt:6.1f} ms | fill [G,D,F] {fl:6.1f} ms | "
            f"read [G,D,F] {rd:6.1f} ms | floor (fill + 2 reads) / dense "
            f"{(fl + 2 * rd) / dt:5.2f}x",
            flush=True,
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--backends", nargs="+", help="default: all registered but reference, pallas_tpu"
    )
    p.add_argument("--ms", nargs="+", type=int, default=[2048, 4096], help="row counts M")
    p.add_argument(
        "--gs", nargs="+", type=int, help=f"expert counts G (default {GS}; --quick {QUICK_GS})"
    )
    p.add_argument(
        "--routings",
        nargs="+",
        default=["balanced", "dirichlet"],
        choices=["balanced", "uniform", "dirichlet"],
    )
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--d", type=int, default=D, help=f"model dim D = K (default {D})")
    p.add_argument("--f", type=int, default=F, help=f"expert hidden dim F = N (default {F})")
    p.add_argument("--reps", type=int, default=5, help="timed (dense, backend) pairs per point")
    p.add_argument(
        "--budget-s",
        type=float,
        help=f"cap on timed seconds per point: slow backends get fewer reps (default "
        f"{BUDGET_S:g}; --quick {QUICK_BUDGET_S:g})",
    )
    p.add_argument(
        "--tm",
        nargs="+",
        type=int,
        default=[0],
        help="row tiles of the blocked backend to compare (0: its default choice)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smallest M only, at most 3 reps, and the quick defaults of --gs, --budget-s",
    )
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument(
        "--floor", action="store_true", help="memory-traffic floor per G (module docstring)"
    )
    p.add_argument(
        "--tpu-aot",
        action="store_true",
        help="TPU ahead-of-time compiler estimates (scripts/bench_gmm_aot.py) instead",
    )
    return p.parse_known_args(argv)


def run_tpu_aot_from(rest: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import bench_gmm_aot
        from bench_gmm_aot import run_tpu_aot
    except ImportError as e:
        print(
            f"--tpu-aot needs scripts/bench_gmm_aot.py (run_tpu_aot), which failed to import: {e}",
            file=sys.stderr,
        )
        return 2
    aot = argparse.ArgumentParser(prog="bench_gmm.py --tpu-aot")
    if hasattr(bench_gmm_aot, "add_args"):
        bench_gmm_aot.add_args(aot)
    run_tpu_aot(aot.parse_args(rest))
    return 0


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    if args.tpu_aot:
        return run_tpu_aot_from(rest)
    if rest:
        print(f"unknown arguments: {rest}", file=sys.stderr)
        return 2
    if any(tm < 0 for tm in args.tm):
        print(f"--tm takes row tiles >= 0 (0: the default choice), got {args.tm}", file=sys.stderr)
        return 2
    gs = args.gs or (QUICK_GS if args.quick else GS)
    if args.floor:
        for dtype in args.dtypes:
            memory_floor(min(args.ms), gs, jnp.dtype(dtype), max(args.reps, 7), args.d, args.f)
        return 0
    available = gmm_lib.available_backends()
    backends = args.backends or [b for b in available if b not in SKIP_BY_DEFAULT]
    unknown = sorted(set(backends) - set(available))
    if unknown:
        print(f"unknown backends {unknown}; registered: {available}", file=sys.stderr)
        return 2
    ms, reps = ([min(args.ms)], min(args.reps, 3)) if args.quick else (args.ms, args.reps)
    budget_s = args.budget_s
    if budget_s is None:
        budget_s = QUICK_BUDGET_S if args.quick else BUDGET_S
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; D={args.d} F={args.f}; "
        f"ratio = backend time / dense matmul time of equal FLOPs",
        flush=True,
    )
    for dtype in args.dtypes:
        if upcast_bf16_dots(jnp.dtype(dtype)):
            print(f"dense {dtype}: operands widened to float32 (no bf16 dots on this CPU)")
    print(HEADER, flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for dtype in args.dtypes:
        for m in ms:
            for g in gs:
                for routing in args.routings:
                    rows += bench_shape(
                        m,
                        g,
                        routing,
                        jnp.dtype(dtype),
                        backends,
                        reps,
                        budget_s,
                        rng,
                        args.d,
                        args.f,
                        args.tm,
                    )
    if args.out:
        args.out.write_text(
            json.dumps(dict(jax=jax.__version__, d=args.d, f=args.f, rows=rows), indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
