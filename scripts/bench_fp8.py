"""An FP8 recipe vs bf16 for one MoE expert FFN: residual memory and CPU time.

    .venv/bin/python scripts/bench_fp8.py memory [--target cpu|v5p:2x2x1|...]   # Qwen3-30B-A3B
    .venv/bin/python scripts/bench_fp8.py time [--tokens 1024 --d 1024 --f 512 --experts 16]
    .venv/bin/python scripts/bench_fp8.py time --recipe fp8_tensorwise   # default fp8_blockwise

Legend: T tokens, K top-k, M = T*K routed rows, D model dim, F expert hidden dim, E experts.
The function is the expert half of an MoE layer: xs = x[rows sorted by expert] (a temporary, as
in the real dispatch), g|u = gmm(xs, w_gate|w_up), h = swiglu(g, u) (kernels/activations.py),
y = gmm(h, w_down), loss = <y, c>. memory: residuals the forward keeps for the backward (from the
jaxpr of jax.vjp, inputs excluded, split into the gmm operands and the rest) and the compiled
temp bytes of the jitted gradient (XLA's memory analysis; AOT for a TPU topology). time: median
wall time of the jitted gradient, bf16 and FP8 with the same backend, in this process. The FP8
side is `Gmm(backend, recipe)` (kernels/quant/), the bf16 side `Gmm(backend)`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # AOT only describes a topology
import moetext  # noqa: E402,F401,I001  (quiets libtpu's TPU probing where there is no TPU)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moetext.kernels import available_recipes, make_recipe  # noqa: E402
from moetext.kernels.activations import swiglu  # noqa: E402
from moetext.kernels.gmm import Gmm, get_backend  # noqa: E402

MiB = 1 << 20


def moe_ffn_loss(op, x_TD, w_in_EDX, w_down_EFD, order_M, sizes_E, topk, act="swiglu"):
    """w_in_EDX: [E, D, 2F] fused gate|up (the MoE layer's layout: models/moe/experts.py
    `swiglu_mlp` runs gate and up as one gmm, so xs is quantized and kept once), or a pair
    ([E, D, F], [E, D, F]) for separate gate and up gmms. act: "swiglu" = the
    layer's kernels.activations.swiglu (keeps g and u as the op's recipe stores activations: FP8
    under fp8_blockwise), "jax" = JAX's autodiff of silu(g) * u. op: the Gmm."""
    xs_MD = x_TD[order_M // topk]
    if isinstance(w_in_EDX, tuple):
        g_MF = op(xs_MD, w_in_EDX[0], sizes_E)
        u_MF = op(xs_MD, w_in_EDX[1], sizes_E)
    else:
        g_MF, u_MF = jnp.split(op(xs_MD, w_in_EDX, sizes_E), 2, axis=-1)
    if act == "swiglu":
        h_MF = swiglu(g_MF, u_MF, gmm=op)
    else:
        h_MF = jax.nn.silu(g_MF) * u_MF
    y_MD = op(h_MF, w_down_EFD, sizes_E)
    # A plain sum: its cotangent is a broadcast constant, so the loss adds no residual.
    return jnp.sum(y_MD.astype(jnp.float32))


def make_args(t, k, d, f, e, fused, sharding=None, concrete=False):
    m = t * k
    w_in = [((e, d, 2 * f), jnp.bfloat16)] if fused else [((e, d, f), jnp.bfloat16)] * 2
    shapes = [((t, d), jnp.bfloat16), *w_in, ((e, f, d), jnp.bfloat16)]
    if concrete:
        rng = np.random.default_rng(0)
        arrs = [
            jnp.asarray(rng.standard_normal(s) * (1.0 if i == 0 else s[-2] ** -0.5), dt)
            for i, (s, dt) in enumerate(shapes)
        ]
        experts = rng.integers(0, e, m)
        order = jnp.asarray(np.argsort(experts, kind="stable"), jnp.int32)
        sizes = jnp.asarray(np.bincount(experts, minlength=e), jnp.int32)
    else:
        arrs = [jax.ShapeDtypeStruct(s, dt, sharding=sharding) for s, dt in shapes]
        order = jax.ShapeDtypeStruct((m,), jnp.int32, sharding=sharding)
        sizes = jax.ShapeDtypeStruct((e,), jnp.int32, sharding=sharding)
    w_in = arrs[1] if fused else (arrs[1], arrs[2])
    return [arrs[0], w_in, arrs[-1], order, sizes]


def _residual_avals(fn, args, keep_inputs=()):
    """Avals of what jax.vjp(fn) keeps for the backward; inputs excluded except keep_inputs."""
    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
    skip = {id(v) for i, v in enumerate(closed.jaxpr.invars) if i not in keep_inputs}
    seen, out = set(), []
    for v in closed.jaxpr.outvars:
        if hasattr(v, "aval") and id(v) not in skip and id(v) not in seen:
            seen.add(id(v))
            out.append(v.aval)
    return out


def _nbytes(avals):
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals)


def residuals(op, args, topk, act):
    """(bytes kept for the gmm lhs operands, bytes of all residuals, residual avals).

    The gmm share is measured on each gmm call alone with its lhs counted (inside the layer the
    lhs is a temporary): bf16 keeps lhs itself, FP8 its values and scales. Weights are
    parameters (inputs) in both.
    """
    layer = _residual_avals(lambda *a: moe_ffn_loss(op, *a, topk, act), args)
    x, w_in, w_down, order, sizes = args
    m, d, f = order.shape[0], x.shape[1], w_down.shape[1]
    calls = [((m, d), w) for w in (w_in if isinstance(w_in, tuple) else (w_in,))]
    calls.append(((m, f), w_down))
    ours = 0
    for lhs_shape, w in calls:
        lhs = jax.ShapeDtypeStruct(lhs_shape, jnp.bfloat16)
        fn = lambda a, w, gs: op(a, w, gs)
        kept = _residual_avals(fn, (lhs, w, sizes), keep_inputs=(0,))
        ours += _nbytes(a for a in kept if jnp.issubdtype(a.dtype, jnp.floating))
    return ours, _nbytes(layer), layer


def compiled_residuals(op, args, topk, act):
    """Bytes of the residuals as XLA lays them out: the outputs of the compiled forward that
    returns exactly what the backward keeps (inputs excluded), including TPU tile padding."""
    loss = lambda *a: moe_ffn_loss(op, *a, topk, act)

    def kept(*a):
        inputs = {id(x) for x in jax.tree_util.tree_leaves(a)}
        _, vjp = jax.vjp(loss, *a)
        return [r for r in jax.tree_util.tree_leaves(vjp) if id(r) not in inputs]

    mem = jax.jit(kept).lower(*args).compile().memory_analysis()
    return mem.output_size_in_bytes


def compiled_temp(op, args, topk, act):
    loss = lambda *a: moe_ffn_loss(op, *a, topk, act)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    mem = grad.lower(*args).compile().memory_analysis()
    return mem.temp_size_in_bytes


def memory(a) -> None:
    if a.target == "cpu":
        sharding, base = None, get_backend(a.backend)
    else:
        from jax.sharding import SingleDeviceSharding

        from moetext.aot import tpu_devices
        from moetext.kernels.gmm.pallas_tpu import PallasTpuBackend

        dev = tpu_devices(a.target)[0]
        sharding, base = SingleDeviceSharding(dev), PallasTpuBackend.for_device(dev)
    args = make_args(a.tokens, a.topk, a.d, a.f, a.experts, a.fused, sharding)
    print(
        f"target {a.target}, backend {base.name}, T={a.tokens} K={a.topk} M={a.tokens * a.topk}"
        f" D={a.d} F={a.f} E={a.experts}, activation {a.activation}"
    )
    rows = {}
    for label, be in (("bf16", Gmm(base)), ("fp8", Gmm(base, make_recipe(a.recipe)))):
        ours, total, detail = residuals(be, args, a.topk, a.activation)
        nan = float("nan")
        temp = compiled_temp(be, args, a.topk, a.activation) if a.compiled else nan
        kept = compiled_residuals(be, args, a.topk, a.activation) if a.compiled else nan
        rows[label] = (ours, total, temp, kept)
        print(
            f"{label}: gmm lhs residuals {ours / MiB:8.1f} MiB | layer residuals "
            f"{total / MiB:8.1f} MiB | compiled residuals {kept / MiB:8.1f} MiB | compiled grad "
            f"temp {temp / MiB:8.1f} MiB"
        )
        print("    layer residuals:", ", ".join(f"{a.shape}{a.dtype.name}" for a in detail))
    pct = lambda i: 100 * (1 - rows["fp8"][i] / rows["bf16"][i])
    print(
        f"{a.recipe} vs bf16: gmm lhs residuals {pct(0):.1f}% less, layer residuals "
        f"{pct(1):.1f}% less, compiled residuals {pct(3):.1f}% less, compiled grad temp "
        f"{pct(2):.1f}% less"
    )


def timing(a) -> None:
    args = make_args(a.tokens, a.topk, a.d, a.f, a.experts, a.fused, concrete=True)
    base = get_backend(a.backend)
    print(f"CPU time, backend {base.name}, T={a.tokens} K={a.topk} D={a.d} F={a.f} E={a.experts}")
    res = {}
    for label, be in (("bf16", Gmm(base)), ("fp8", Gmm(base, make_recipe(a.recipe)))):
        loss = functools.partial(moe_ffn_loss, be, topk=a.topk, act=a.activation)
        for what, fn in (
            ("fwd", jax.jit(loss)),
            ("fwd+bwd", jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))),
        ):
            jax.block_until_ready(fn(*args))
            ts = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                ts.append(time.perf_counter() - t0)
            res[label, what] = float(np.median(ts))
            print(f"{label:>5} {what:>8}: {res[label, what] * 1e3:9.1f} ms (median of {a.repeats})")
    for what in ("fwd", "fwd+bwd"):
        print(f"{a.recipe} / bf16 {what}: {res['fp8', what] / res['bf16', what]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["memory", "time"])
    p.add_argument("--target", default="cpu", help="cpu, or a TPU topology such as v5p:2x2x1")
    p.add_argument("--backend", default="blocked", help="gmm backend for the cpu target")
    p.add_argument(
        "--recipe",
        default="fp8_blockwise",
        choices=[r for r in available_recipes() if r != "none"],
        help="the quantization recipe measured against bf16",
    )
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--d", type=int, default=None)
    p.add_argument("--f", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--activation",
        choices=["swiglu", "jax"],
        default="swiglu",
        help="swiglu: the layer's (keeps g, u; FP8 under fp8); jax: autodiff of silu(g) * u",
    )
    p.add_argument(
        "--unfused",
        dest="fused",
        action="store_false",
        help="separate gate and up gmms (xs quantized for each) instead of one [E,D,2F]",
    )
    p.add_argument(
        "--no-compiled",
        dest="compiled",
        action="store_false",
        help="memory: skip the (slow) compiled memory analysis",
    )
    a = p.parse_args()
    # memory defaults: Qwen3-30B-A3B layer shapes; time defaults: a shape 2 CPU cores can run.
    big = a.mode == "memory"
    a.tokens = a.tokens or (8192 if big else 1024)
    a.d, a.f = a.d or (2048 if big else 1024), a.f or (768 if big else 512)
    a.experts = a.experts or (128 if big else 16)
    memory(a) if big else timing(a)


if __name__ == "__main__":
    main()
