"""train.separate_update: the step as two programs (gradient, then update) equals one program.

Both run the same float32 computations of tiny-qwen3-moe; what differs is how XLA fuses
across the program boundary (measured on CPU: the losses are bitwise equal, the grad norm
differs by 1.1e-7 relative, a different summation order). Tolerances are a few times what was
measured; a wrong gradient or update handed between the programs would be off by O(1).
"""

from pathlib import Path

import jax
import numpy as np

from moetext import config, program
from moetext.data.batch import from_tokens

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
B, S = 4, 16


def _two_steps(separate: bool, extra: tuple[str, ...] = ()):
    cfg = config.load(
        TINY,
        [
            "train.progress_bar=false",
            "checkpoint.enabled=false",
            "data.kind=synthetic",
            f"data.seq_len={S}",
            f"data.global_batch_size={B}",
            "optim.warmup_steps=0",
            f"train.separate_update={str(separate).lower()}",
            *extra,
        ],
    )
    b = program.build(cfg)
    step = program.jit_train_step(b)
    assert isinstance(step, program.TwoPrograms) is separate
    rng = np.random.default_rng(0)
    init = jax.device_get(b.state.params)
    state, metrics = b.state, []
    for _ in range(2):
        batch = from_tokens(rng.integers(0, 512, (B, S + 1)).astype(np.int32))
        state, m = step(state, program.put_batch(batch, b.batch_sharding))
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics, init


def _rel_err(a, b) -> float:
    errs = jax.tree.map(
        lambda x, y: float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)), a, b
    )
    return max(jax.tree.leaves(errs))


def test_two_programs_equal_one_program():
    # Adam's m / (sqrt(v) + eps) amplifies rounding noise where |g| ~ eps (1e-8 by default):
    # eps = 1e-3 keeps the update Lipschitz in g, as tests/train/test_grad_accum.py does.
    one_state, one_m, init = _two_steps(False, ("optim.eps=1e-3",))
    two_state, two_m, _ = _two_steps(True, ("optim.eps=1e-3",))
    assert int(two_state.step) == int(one_state.step) == 2
    # Params and both Adam moments after two updates, relative to each tensor's largest entry.
    # Measured: params 1.4e-7, moments 9.8e-7.
    assert _rel_err(two_state.params, one_state.params) <= 1e-6
    assert _rel_err(two_state.opt_state, one_state.opt_state) <= 5e-6
    # Every metric of both steps. Measured: at most 1.1e-7 (the grad norm, router z-loss).
    for m2, m1 in zip(two_m, one_m, strict=True):
        assert m2.keys() == m1.keys()
        assert _rel_err(m2, m1) <= 1e-6, (m2, m1)
    assert _rel_err(two_state.params, init) > 1e-4  # the steps moved the params
