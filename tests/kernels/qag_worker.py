"""The 8-device checks of test_fp8_qag.py: `python -m tests.kernels.qag_worker`.

Runs on 8 fake CPU devices (a 2 x 4 mesh, axes a and b; the device count is fixed when jax
initialises, so tests/fake_devices.py starts it in a fresh interpreter) and prints one line
`RESULT <json>` with:

- "qag": per shard layout, whether quantized_all_gather equals Quantized.of on the full array
  (value, scale, axis);
- "gmm": per backend and recipe, max relative errors of (loss, dlhs, drhs) of gmm with QAG
  against the same recipe on the weight gathered in bf16 and quantized after (save_rhs="fp8"),
  and against the default recipe (the input kept for the backward); for the blocked backend
  also the QAG gmm with its weight gradient reduce-scattered in column tiles against in one piece,
  and the scale of its bound (drhs_abs_scale);
- "plain": rhs_gather without quantization against gmm on the full weight;
- "hlo": element types of the all-gathers (and reduce-scatters) in the lowered StableHLO;
- "bf16_reduce": grad_reduce_dtype=bfloat16 against the f32 gradient reduction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from moetext.kernels import gmm as gmm_lib
from moetext.kernels.gmm import Gmm
from moetext.kernels.gmm import gather as gather_lib
from moetext.kernels.gmm.gather import Gather, gather_weight
from moetext.kernels.quant import Fp8Blockwise
from moetext.kernels.quant import fp8_quantize as fp8
from moetext.kernels.quant.qag import quantized_all_gather

# Shapes of section 2: rows per shard, contraction, outputs, groups.
M, K, N, G = 48, 256, 96, 4
GROUP_SIZES = (10, 20, 0, 18)  # per shard: 48 rows, one empty group
ALL_GATHER_DTYPES = r"stablehlo\.all_gather.*?->\s*tensor<[0-9x]*x(\w+)>"
REDUCE_SCATTER_DTYPES = r"stablehlo\.reduce_scatter.*?->\s*tensor<[0-9x]*x(\w+)>"

# name: (shape, PartitionSpec entries, blocked axis, block size, FP8 dtype). Shard sizes below /
# at / above a block, a ragged unsharded blocked axis, square tiles split over two mesh axes,
# e5m2 with the experts dim sharded too.
QAG_CASES: dict[str, tuple[tuple[int, ...], tuple[Any, ...], int | None, int, str]] = {
    "straddle_n64_bs128": ((4, 512, 96), (None, ("a", "b"), None), 1, 128, "float8_e4m3fn"),
    "aligned_n256_bs128": ((4, 2048, 96), (None, ("a", "b"), None), 1, 128, "float8_e4m3fn"),
    "gcd16_n48_bs128": ((4, 384, 96), (None, ("a", "b"), None), 1, 128, "float8_e4m3fn"),
    "ragged_unsharded_axis": ((4, 384, 100), (None, "b", None), 2, 128, "float8_e4m3fn"),
    "tiles_two_axes": ((4, 384, 256), (None, "a", "b"), None, 128, "float8_e4m3fn"),
    "gcd1_n5_bs16": ((4, 40, 24), (None, ("a", "b"), None), 1, 16, "float8_e4m3fn"),
    "e5m2_experts_dim_too": ((8, 256, 64), ("a", "b", None), 1, 32, "float8_e5m2"),
}


def gather_of(spec: tuple[Any, ...]) -> Gather:
    """The Gather that undoes a PartitionSpec: (dim, mesh axes) for each sharded dim."""
    return tuple((d, (s,) if isinstance(s, str) else s) for d, s in enumerate(spec) if s)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b|."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def dtypes_in(pattern: str, text: str, flags: int = 0) -> list[str]:
    return sorted(set(re.findall(pattern, text, flags)))


def gathered(
    xl: jax.Array, *, spec: tuple[Any, ...], axis: int | None, bs: int, dt: str
) -> fp8.Quantized:
    """This shard's slice quantized and all-gathered (inside shard_map)."""
    return quantized_all_gather(xl, gather_of(spec), axis=axis, block_size=bs, dtype=dt)


def check_qag(mesh: Mesh, rng: np.random.Generator) -> dict[str, dict[str, bool]]:
    """1. quantized_all_gather == Quantized.of(full array), bitwise, for every QAG_CASES layout."""
    out = {}
    for name, (shape, spec, axis, bs, dt) in QAG_CASES.items():
        normal = rng.standard_normal(shape)  # drawn before the scales (the data tested)
        x = jnp.asarray(normal * 10.0 ** rng.integers(-3, 3, shape), jnp.bfloat16)
        x = x.at[0, :64].set(0)  # all-zero blocks
        fn = jax.shard_map(
            functools.partial(gathered, spec=spec, axis=axis, bs=bs, dt=dt),
            mesh=mesh,
            in_specs=P(*spec),
            out_specs=P(),
            check_vma=False,
        )
        got = jax.jit(fn)(x)
        ref = fp8.Quantized.of(x, axis=axis, block_size=bs, dtype=dt, impl="xla")
        out[name] = {
            "value_equal": bool(
                np.array_equal(np.asarray(got.value, np.float32), np.asarray(ref.value, np.float32))
            ),
            "scale_equal": bool(np.array_equal(np.asarray(got.scale), np.asarray(ref.scale))),
            "axis_equal": got.axis == ref.axis,
        }
    return out


class ShardedGmm:
    """gmm over 8 shards on a weight split along K (the contraction, like fsdp on D), x split by
    rows; `grads` returns (loss, dlhs, drhs) in float64 and the lowered StableHLO text."""

    def __init__(self, mesh: Mesh, rng: np.random.Generator) -> None:
        self.mesh = mesh
        self.x = jnp.asarray(rng.standard_normal((8 * M, K)), jnp.bfloat16)
        self.w = jnp.asarray(rng.standard_normal((G, K, N)) * 0.1, jnp.float32)  # f32 master
        self.wt = jnp.swapaxes(self.w, 1, 2)  # [G, N, K] for transpose_rhs
        self.gs = jnp.asarray(GROUP_SIZES, jnp.int32)

    def grads(
        self,
        op: str | Gmm,
        *,
        transpose: bool = False,
        gathered_outside: bool = False,
        w: jax.Array | None = None,
        reduce_dtype: Any = None,
    ) -> tuple[list[np.ndarray], str]:
        w = self.w if w is None else w
        gs = self.gs
        if isinstance(op, str):
            op = Gmm(gmm_lib.get_backend(op))
        if reduce_dtype is not None:
            op = dataclasses.replace(op, grad_reduce_dtype=jnp.dtype(reduce_dtype).name)
        spec = P(None, None, ("a", "b")) if transpose else P(None, ("a", "b"), None)
        gather: Gather = ((2 if transpose else 1, ("a", "b")),)

        def body(xl: jax.Array, wl: jax.Array) -> jax.Array:
            kw: dict[str, Any] = dict(preferred_element_type=jnp.bfloat16, transpose_rhs=transpose)
            if gathered_outside:  # the plain path, outside the recipe
                full = gather_weight(wl, gather, jnp.bfloat16)
                return op(xl, full, gs, **kw)
            return op(xl, wl, gs, rhs_gather=gather, **kw)

        f = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(P(("a", "b")), spec),
            out_specs=P(("a", "b")),
            check_vma=False,
        )

        def loss(x: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))

        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(self.x, w)
        v, (gx, gw) = lowered.compile()(self.x, w)
        return [np.asarray(a, np.float64) for a in (v, gx, gw)], lowered.as_text()


def quantized(name: str, qag: bool, **recipe: Any) -> Gmm:
    r = Fp8Blockwise(block_size=64, qag=qag, **recipe)  # 32-wide K shards: 2 per block
    return Gmm(gmm_lib.get_backend(name), r)


def check_qag_gmm(s: ShardedGmm) -> dict[str, dict[str, Any]]:
    """2. gmm on a weight slice (rhs_gather): QAG vs gathering in bf16 and quantizing the copy."""
    out: dict[str, dict[str, Any]] = {}
    for name in ("reference", "ragged_dot", "blocked"):
        for bwd, wb in ((False, "1x64"), (True, "64x64"), (True, "1x64")):
            for transpose in (False, True) if name == "blocked" else (False,):
                key = f"{name}/bwd_quantize={bwd}/{wb}/transpose={transpose}"
                rec = dict(bwd_quantize=bwd, weight_block=wb)
                w = s.wt if transpose else s.w
                q, _ = s.grads(quantized(name, True, **rec), transpose=transpose, w=w)
                ref, _ = s.grads(
                    quantized(name, False, save_rhs="fp8", **rec),
                    gathered_outside=True,
                    transpose=transpose,
                    w=w,
                )
                inp, _ = s.grads(quantized(name, False, **rec), transpose=transpose, w=w)
                out[key] = {
                    "vs_fp8_saved": [rel(a, b) for a, b in zip(q, ref, strict=True)],
                    "vs_input_saved": [rel(a, b) for a, b in zip(q, inp, strict=True)],
                }
                if name == "blocked":
                    tiled = _in_column_tiles(
                        lambda rec=rec, t=transpose, w=w: s.grads(
                            quantized("blocked", True, **rec), transpose=t, w=w
                        )[0]
                    )
                    out[key]["tiled_vs_whole"] = [rel(a, b) for a, b in zip(tiled, q, strict=True)]
                    out[key]["drhs_abs_scale"] = drhs_abs_scale(s, q[2])
    return out


def drhs_abs_scale(s: ShardedGmm, gw: np.ndarray) -> float:
    """The largest sum of |products| a weight-gradient entry adds up, over its largest entry:
    entry (g, k, n) sums x[r, k] * dout[r, n] over group g's rows of every shard, and
    |dout| = |cos(out)| <= 1, so that sum is at most sum_r |x[r, k]|."""
    x_SMK = np.abs(np.asarray(s.x, np.float64)).reshape(-1, M, K)
    ends = np.cumsum(GROUP_SIZES)
    starts = ends - np.asarray(GROUP_SIZES)
    a_GK = np.stack([x_SMK[:, lo:hi].sum(axis=(0, 1)) for lo, hi in zip(starts, ends, strict=True)])
    return float(a_GK.max() / np.abs(gw).max())


def _in_column_tiles(run: Any) -> Any:
    """run() with the weight gradient reduce-scattered in tiles of 8 columns (12 tiles of N =
    96), as gather.reduce_scatter_tiled does at full size (tests/kernels/gather_worker.py)."""
    with gather_lib.grad_tile_limits(1, 8):
        return run()


def check_plain(s: ShardedGmm) -> tuple[dict[str, list[float]], dict[str, list[str]]]:
    """3. rhs_gather without quantization == the gmm on the full f32 weight (no shard_map)."""
    plain, hlo = {}, {}
    for name in ("reference", "blocked"):
        got, text = s.grads(name)

        # Every shard uses the same group sizes, so the oracle runs each 48-row block on its own.
        def loss(x: jax.Array, w: jax.Array, name: str = name) -> jax.Array:
            ys = [
                gmm_lib.gmm(
                    xb,
                    w.astype(jnp.bfloat16),
                    s.gs,
                    backend=name,
                    preferred_element_type=jnp.dtype(jnp.bfloat16),
                )
                for xb in jnp.split(x, 8)
            ]
            return jnp.sum(jnp.sin(jnp.concatenate(ys).astype(jnp.float32)))

        v, (gx, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(s.x, s.w)
        want = [np.asarray(a, np.float64) for a in (v, gx, gw)]
        plain[name] = [rel(a, b) for a, b in zip(got, want, strict=True)]
        hlo["plain_" + name] = dtypes_in(ALL_GATHER_DTYPES, text)
    return plain, hlo


def check_wire_dtypes(s: ShardedGmm) -> dict[str, list[str]]:
    """What the QAG gmm's all-gathers and gradient reduce-scatters carry."""
    _, text = s.grads(quantized("blocked", True, bwd_quantize=False, weight_block="1x64"))
    return {
        "qag": dtypes_in(ALL_GATHER_DTYPES, text),
        "qag_reduce_scatter": dtypes_in(REDUCE_SCATTER_DTYPES, text, re.S),
    }


def check_bf16_reduce(s: ShardedGmm) -> dict[str, Any]:
    """4. grad_reduce_dtype=bfloat16: the weight gradient is reduce-scattered in bf16 (plain and
    QAG)."""
    f32_reduced, _ = s.grads("blocked")
    bf16_reduced, text = s.grads("blocked", reduce_dtype=jnp.bfloat16)
    q = quantized("blocked", True, bwd_quantize=False, weight_block="1x64")
    _, qag_text = s.grads(q, reduce_dtype=jnp.bfloat16)
    return {
        "rel": [rel(a, b) for a, b in zip(bf16_reduced, f32_reduced, strict=True)],
        "dtypes": dtypes_in(REDUCE_SCATTER_DTYPES, text, re.S),
        "qag_dtypes": dtypes_in(REDUCE_SCATTER_DTYPES, qag_text, re.S),
    }


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    res: dict[str, Any] = {"qag": check_qag(mesh, rng)}
    s = ShardedGmm(mesh, rng)
    res["gmm"] = check_qag_gmm(s)
    res["plain"], res["hlo"] = check_plain(s)
    res["hlo"].update(check_wire_dtypes(s))
    res["bf16_reduce"] = check_bf16_reduce(s)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
