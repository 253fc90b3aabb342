"""The 8-device checks of test_gmm_gather.py: `python -m tests.kernels.gather_worker`.

Runs on 8 fake CPU devices (a 2 x 4 mesh, axes a and b; tests/fake_devices.py starts it in a
fresh interpreter) and prints one line `RESULT <json>`: per weight layout, backend and gradient
reduction dtype, the relative differences (loss, dlhs, drhs) of gmm on an all-gathered weight
slice (`rhs_gather`) with the weight gradient reduce-scattered in tiles against the same call
in one piece, and against gmm on the whole weight (no sharding); the call with
`regather_weights` (gathered again in the backward) against the one keeping the forward's copy;
the slice gathered with its last two dims swapped (gather.minor_swapped) against it gathered as
given, with the scales of its bounds (swap_scales); plus how many tiles ran, and the scale of
the tiled gradient's bound (drhs_abs_scale); a weight split over two mesh axes gathered in one
collective (gather_jointly) against one axis at a time.
"""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moetext.kernels import gmm as gmm_lib
from moetext.kernels.gmm import api as gmm_api
from moetext.kernels.gmm import gather

M, K, N, G = 40, 64, 48, 4  # rows per shard, contraction, outputs, groups
SHARDS = 8
# name: (PartitionSpec of the weight [G, K, N] (or [G, N, K] with transpose_rhs), Gather,
# transpose_rhs). The gradient is tiled along an ungathered dim when there is one, else along a
# gathered one (each shard's block viewed as tiles).
LAYOUTS: dict[str, tuple[tuple[Any, ...], gmm_lib.Gather, bool]] = {
    "K_over_b": ((None, "b", None), ((1, ("b",)),), False),
    "N_over_b": ((None, None, "b"), ((2, ("b",)),), False),
    "K_over_ab": ((None, ("a", "b"), None), ((1, ("a", "b")),), False),
    "K_over_a_N_over_b": ((None, "a", "b"), ((1, ("a",)), (2, ("b",))), False),
    "transposed_N_over_b": ((None, "b", None), ((1, ("b",)),), True),
}


def rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def run(
    mesh: Mesh,
    layout: str,
    backend: str,
    reduce_dtype: str | None,
    x: np.ndarray,
    w: np.ndarray,
    ids: np.ndarray,
    regather: bool = False,
    count_gathers: bool = False,
    jointly: bool = False,
) -> tuple[float, np.ndarray, np.ndarray]:
    """(loss, dlhs, drhs); with count_gathers, (all_gather ops in the gradient's jaxpr, -, -)."""
    spec, gather_dims, transpose = LAYOUTS[layout]
    op = gmm_lib.Gmm(
        gmm_lib.get_backend(backend), grad_reduce_dtype=reduce_dtype, regather_weights=regather
    )

    def body(xl: jax.Array, wl: jax.Array, il: jax.Array) -> jax.Array:
        order = jnp.argsort(il, stable=True)
        sizes = jnp.bincount(il, length=G).astype(jnp.int32)
        out = op(
            xl[order],
            wl,
            sizes,
            transpose_rhs=transpose,
            rhs_gather=gather_dims,
            gather_jointly=jointly,
        )
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) ** 2), ("a", "b"))

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(("a", "b")), P(*spec), P(("a", "b"))),
        out_specs=P(),
        check_vma=False,
    )
    grad = jax.value_and_grad(lambda x, w: f(x, w, jnp.asarray(ids)), argnums=(0, 1))
    if count_gathers:
        jaxpr = str(jax.make_jaxpr(grad)(jnp.asarray(x), jnp.asarray(w)))
        return jaxpr.count("all_gather["), np.zeros(0), np.zeros(0)
    loss, (gx, gw) = jax.jit(grad)(jnp.asarray(x), jnp.asarray(w))
    return float(loss), np.asarray(gx), np.asarray(gw)


def unsharded(
    backend: str, transpose: bool, x: np.ndarray, w: np.ndarray, ids: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """The same loss with each shard's rows multiplied by the whole weight, no collectives."""

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        total = jnp.zeros((), jnp.float32)
        for s in range(SHARDS):
            il = jnp.asarray(ids[s * M : (s + 1) * M])
            order = jnp.argsort(il, stable=True)
            sizes = jnp.bincount(il, length=G).astype(jnp.int32)
            out = gmm_lib.gmm(
                x[s * M : (s + 1) * M][order], w, sizes, backend=backend, transpose_rhs=transpose
            )
            total = total + jnp.sum(out.astype(jnp.float32) ** 2)
        return total

    value, (gx, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
        jnp.asarray(x), jnp.asarray(w)
    )
    return float(value), np.asarray(gx), np.asarray(gw)


def drhs_abs_scale(
    x: np.ndarray, w: np.ndarray, ids: np.ndarray, transpose: bool, gw: np.ndarray
) -> float:
    """The largest sum of |products| a weight-gradient entry adds up, over its largest entry:
    entry (g, k, n) sums x[r, k] * dout[r, n] over the rows r of group g (every shard), and
    dout = 2 * out (the loss is sum(out^2)), out[r] = x[r] @ w[g]."""
    x64 = np.asarray(x, np.float64)
    w_GKN = np.asarray(np.swapaxes(w, 1, 2) if transpose else w, np.float64)
    out_RN = np.einsum("rk,rkn->rn", x64, w_GKN[ids])
    onehot_RG = np.eye(G)[ids]
    a_GKN = np.einsum("rg,rk,rn->gkn", onehot_RG, np.abs(x64), 2 * np.abs(out_RN))
    return float(a_GKN.max() / np.abs(gw).max())


def swap_scales(
    x: np.ndarray, w_GKN: np.ndarray, ids: np.ndarray, ref: tuple[float, np.ndarray, np.ndarray]
) -> dict[str, float]:
    """The data-dependent factors of the swapped-vs-not bounds (test_gmm_gather.py), with
    A[r, n] = sum_k |x[r, k] * w[g_r, k, n]| (what bounds out[r, n]'s rounding) and
    dout = 2 out: the loss's sum of |out| * A over the loss; for dlhs the largest
    sum_n A * |w| and sum_n |dout * w| an entry adds up, for drhs the largest sum_r |x| * A
    and sum_r |x * dout|, each over the largest entry of `ref`'s gradient."""
    x64, w_RKN = np.asarray(x, np.float64), np.asarray(w_GKN, np.float64)[ids]
    out_RN = np.einsum("rk,rkn->rn", x64, w_RKN)
    a_RN = np.einsum("rk,rkn->rn", np.abs(x64), np.abs(w_RKN))
    onehot_RG = np.eye(G)[ids]
    loss, dlhs, drhs = ref
    scales = {"loss": float(np.sum(np.abs(out_RN) * a_RN) / loss)}
    for name, m_RN in (("A", a_RN), ("dout", 2 * np.abs(out_RN))):
        dlhs_RK = np.einsum("rn,rkn->rk", m_RN, np.abs(w_RKN))
        drhs_GKN = np.einsum("rg,rk,rn->gkn", onehot_RG, np.abs(x64), m_RN)
        scales[f"dlhs_{name}"] = float(dlhs_RK.max() / np.abs(dlhs).max())
        scales[f"drhs_{name}"] = float(drhs_GKN.max() / np.abs(drhs).max())
    return scales


def tiles_of(layout: str) -> int:
    """How many tiles reduce_scatter_tiled runs for the layout at the patched sizes."""
    spec, gather_dims, transpose = LAYOUTS[layout]
    shape = (G, N, K) if transpose else (G, K, N)
    sizes = {"a": 2, "b": 4}

    def shards(g: gmm_lib.Gather) -> dict[int, int]:
        return {d: int(np.prod([sizes[a] for a in axes])) for d, axes in g}

    local = tuple(n // shards(gather_dims).get(d, 1) for d, n in enumerate(shape))
    swapped = None if transpose else gather.minor_swapped(local, gather_dims)
    if swapped is not None:  # what Gmm runs: the [G, N, K] slice gathered along N
        shape, gather_dims = (G, N, K), swapped
    return gather.grad_tiles(shape, shards(gather_dims), 4)[1]


def main() -> None:
    assert jax.device_count() == SHARDS, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SHARDS * M, K)).astype(np.float32)
    ids = rng.integers(0, G, SHARDS * M).astype(np.int32)
    ids[:M] = np.where(ids[:M] == 2, 1, ids[:M])  # shard 0 has an empty group
    out: dict[str, Any] = {
        "tiled_vs_whole": {},
        "tiled_vs_unsharded": {},
        "drhs_abs_scale": {},
        "regather_vs_whole": {},
        "tiles": {},
    }
    for layout, (_, _, transpose) in LAYOUTS.items():
        w = rng.standard_normal((G, N, K) if transpose else (G, K, N)).astype(np.float32)
        for backend in ("ragged_dot", "blocked"):
            ref = unsharded(backend, transpose, x, w, ids)
            for reduce_dtype in (None, "bfloat16"):
                key = f"{layout}/{backend}/{reduce_dtype or 'param'}"
                whole = run(mesh, layout, backend, reduce_dtype, x, w, ids)
                again = run(mesh, layout, backend, reduce_dtype, x, w, ids, regather=True)
                out["regather_vs_whole"][key] = [
                    rel(a, u) for a, u in zip(again, whole, strict=True)
                ]
                # Tiles of 8 columns (per shard where the tiled dim is gathered), whatever size.
                with gather.grad_tile_limits(1, 8):
                    tiled = run(mesh, layout, backend, reduce_dtype, x, w, ids)
                    out["tiles"][layout] = tiles_of(layout)
                out["tiled_vs_whole"][key] = [rel(t, u) for t, u in zip(tiled, whole, strict=True)]
                out["drhs_abs_scale"][key] = drhs_abs_scale(x, w, ids, transpose, whole[2])
                out["tiled_vs_unsharded"][key] = [
                    rel(t, u) for t, u in zip(tiled, ref, strict=True)
                ]
    # How many all-gathers the gradient's program runs, keeping the forward's copy or not.
    w = rng.standard_normal((G, K, N)).astype(np.float32)
    out["all_gathers"] = {
        str(flag): run(mesh, "K_over_b", "blocked", None, x, w, ids, flag, count_gathers=True)[0]
        for flag in (False, True)
    }
    # K over (a, b) all-gathered in one collective over both axes (WeightGather.jointly)
    # against one axis at a time: the same blocks in the same order, the same reduce-scatters.
    out["jointly_vs_per_axis"] = {}
    for backend in ("ragged_dot", "blocked"):
        joint = run(mesh, "K_over_ab", backend, None, x, w, ids, jointly=True)
        per_axis = run(mesh, "K_over_ab", backend, None, x, w, ids)
        out["jointly_vs_per_axis"][backend] = [
            rel(a, u) for a, u in zip(joint, per_axis, strict=True)
        ]
    out["all_gathers_jointly"] = {
        str(flag): run(
            mesh, "K_over_ab", "blocked", None, x, w, ids, count_gathers=True, jointly=flag
        )[0]
        for flag in (False, True)
    }
    # The layout whose slice is gathered with its last two dims swapped (gather.minor_swapped:
    # the local N = 12 is under TPU_LANES) against the same call gathered along N as given.
    out["swapped_vs_not"], out["swap_scales"] = {}, {}
    for backend in ("ragged_dot", "blocked"):
        for reduce_dtype in (None, "bfloat16"):
            key = f"N_over_b/{backend}/{reduce_dtype or 'param'}"
            answers: list[Any] = []

            def asked(shape: Any, g: Any, answers: list[Any] = answers) -> Any:
                answers.append(gather.minor_swapped(shape, g))
                return answers[-1]

            with mock.patch.object(gmm_api, "minor_swapped", asked):
                swapped = run(mesh, "N_over_b", backend, reduce_dtype, x, w, ids)
            assert answers == [((1, ("b",)),)], answers  # Gmm did swap: dim 2 gathered as 1
            with mock.patch.object(gmm_api, "minor_swapped", lambda shape, g: None):
                not_swapped = run(mesh, "N_over_b", backend, reduce_dtype, x, w, ids)
            out["swapped_vs_not"][key] = [
                rel(a, u) for a, u in zip(swapped, not_swapped, strict=True)
            ]
            out["swap_scales"][key] = swap_scales(x, w, ids, not_swapped)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
