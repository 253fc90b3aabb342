"""The 8-device check of test_splash.py: `python -m tests.models.splash_worker`.

On 8 fake CPU devices (mesh data 2 x fsdp 2 x tensor 2, rules splitting the batch over data and
fsdp and the heads over tensor, as the fsdp_tp preset does), splash attention under the rules
runs per shard in a shard_map; prints `RESULT <json>`: whether the jaxpr holds the shard_map,
and the relative differences of its output and q, k, v gradients against `attend` on XLA
without rules (one device's view), over the rows of real (non-padding) segments.
"""

from __future__ import annotations

import json

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from moetext.models.layers.attention import attend
from moetext.sharding import logical

B, S, N, K, H = 4, 256, 4, 2, 64
RULES = [("batch", ["data", "fsdp"]), ("length", None), ("heads", "tensor"),
         ("kv_heads", "tensor"), ("head_dim", None)]  # fmt: skip


def rel(a: jax.Array, b: jax.Array, rows: np.ndarray) -> float:
    x, y = np.asarray(a, np.float64)[rows], np.asarray(b, np.float64)[rows]
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def main() -> None:
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, S, N, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, S, K, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, S, K, H)), jnp.float32)
    ids = np.ones((B, S), np.int32)
    ids[:, 150:] = 2
    ids[1::2, 220:] = 0  # padding at the end of odd rows
    seg = jnp.asarray(ids)
    real = ids != 0
    w = jnp.asarray(r.normal(size=(B, S, N, H)) * real[:, :, None, None], jnp.float32)

    def f(kernel: str):
        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
            out = attend(q, k, v, seg, kernel=kernel)  # type: ignore[arg-type]
            return jnp.sum(out * w), out

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    with logical.use_rules(mesh, RULES):
        sharded = jax.jit(f("splash"))
        shard_map = "shard_map" in str(jax.make_jaxpr(f("splash"))(q, k, v))
        (_, out_s), grads_s = sharded(q, k, v)
    (_, out_x), grads_x = jax.jit(f("xla"))(q, k, v)
    every = np.ones_like(real)
    result = {
        "shard_map": shard_map,
        "rel": {
            "out": rel(out_s, out_x, real),
            "dq": rel(grads_s[0], grads_x[0], real),
            "dk": rel(grads_s[1], grads_x[1], every),
            "dv": rel(grads_s[2], grads_x[2], every),
        },
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
