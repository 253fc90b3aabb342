"""AdamW with warmup + cosine decay, global-norm clipping, and no decay on norms/biases;
train.freeze keeps matching params fixed with no optimizer state for them."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moetext.config import OptimConfig
from moetext.errors import ConfigError

# A param's key path in the params tree -> the "/"-joined unscanned names it holds: one name,
# or under model.scan_layers one per layer of its stack ("layers/3/mlp/router/w", ...).
ParamNames = Callable[[tuple[Any, ...]], list[str]]


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to min_lr_ratio * peak over
    optim.decay_steps (default: the steps left after warmup), flat after that."""
    decay = (
        cfg.decay_steps if cfg.decay_steps is not None else max(total_steps - cfg.warmup_steps, 1)
    )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.warmup_steps + decay,
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def decay_mask(params: Any) -> Any:
    """True for the leaves weight decay applies to: weight matrices and expert stacks (ndim >=
    2, embeddings included); False for norm scales, biases and other vectors."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build(
    cfg: OptimConfig,
    total_steps: int,
    *,
    freeze: Sequence[str] = (),
    param_names: ParamNames | None = None,
) -> optax.GradientTransformation:
    """Global-norm clipping (unless optim.clip_norm is None), then AdamW on `schedule`.

    freeze (train.freeze): params whose unscanned name (`param_names`) fully matches one of
    these regexes get no update and no optimizer state (optax.multi_transform: AdamW and the
    clipping norm see only the trained params)."""
    trained = adamw(cfg, total_steps)
    if not freeze:
        return trained
    assert param_names is not None, "train.freeze needs the params' names"
    labels = lambda params: freeze_labels(params, freeze, param_names)
    return optax.multi_transform({"train": trained, "frozen": optax.set_to_zero()}, labels)


def freeze_labels(params: Any, freeze: Sequence[str], param_names: ParamNames) -> Any:
    """A tree like params of "frozen" / "train". Raises ConfigError for a pattern that matches
    no param, or one that matches only some layers of a scan_layers stack (one array)."""
    patterns = [re.compile(p) for p in freeze]
    used = [False] * len(patterns)

    def label(path: tuple[Any, ...], _: Any) -> str:
        names = param_names(path)
        hits = [[bool(p.fullmatch(n)) for p in patterns] for n in names]
        for i in range(len(patterns)):
            used[i] |= any(h[i] for h in hits)
        frozen = [any(h) for h in hits]
        if any(frozen) and not all(frozen):
            some = [n for n, f in zip(names, frozen, strict=True) if f]
            raise ConfigError(
                f"train.freeze matches {some} but not the other layers stacked with them in "
                f"one array under model.scan_layers=true ({names[0]} ... {names[-1]}): freeze "
                f"every layer of the stack, or set model.scan_layers=false"
            )
        return "frozen" if all(frozen) else "train"

    labels = jax.tree_util.tree_map_with_path(label, params)
    unused = [p for p, u in zip(freeze, used, strict=True) if not u]
    if unused:
        example = [n for path, _ in jax.tree_util.tree_leaves_with_path(params)[:4]
                   for n in param_names(path)[:1]]  # fmt: skip
        raise ConfigError(
            f"train.freeze patterns {unused} match no parameter (a pattern must match a whole "
            f"'/'-joined unscanned name, e.g. {example})"
        )
    return labels


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with one division per step instead of one per element: where
    the global norm n reaches max_norm every update is multiplied by the scalar max_norm / n
    (optax divides each element by n, then multiplies by max_norm; the two differ in the last
    bit). The state is optax's own, so checkpoints and optimizer states carry over.

    Why: XLA keeps an elementwise division out of the fusions that consume its result, so
    optax's clipped gradient of every leaf is written out whole and read back by the first- and
    second-moment updates; a multiply by a scalar fuses into both: one fewer pass over every
    leaf. bench-tiny-moe's whole update on the 2-core CPU in 0.65x the time with optax's clip
    (scripts/bench_optim.py; docs/performance.md)."""
    base = optax.clip_by_global_norm(max_norm)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        norm = optax.tree.norm(updates)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformation(base.init, update)


Clip = Callable[[float], optax.GradientTransformation]


def adamw(
    cfg: OptimConfig, total_steps: int, clip: Clip = clip_by_global_norm
) -> optax.GradientTransformation:
    """`clip(cfg.clip_norm)` (unless clip_norm is None), then AdamW on `schedule` with no decay
    on vectors (`decay_mask`). clip: moetext's clip, or another with its signature
    (scripts/bench_optim.py times this chain with optax.clip_by_global_norm)."""
    parts: list[optax.GradientTransformation] = []
    if cfg.clip_norm is not None:
        parts.append(clip(cfg.clip_norm))
    parts.append(
        optax.adamw(
            schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
