"""AdamW with warmup + cosine decay, global-norm clipping, and no decay on norms/biases."""

from __future__ import annotations

from typing import Any

import jax
import optax

from moetext.config import OptimConfig


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


def build(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping (unless optim.clip_norm is None), then AdamW on `schedule`."""
    parts: list[optax.GradientTransformation] = []
    if cfg.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
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
