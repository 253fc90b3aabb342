"""The MoE section's routing checks (group layout, balancing, scope), run by
`MoEConfig.__post_init__`: one ConfigError naming the fields."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moetext.errors import ConfigError

if TYPE_CHECKING:
    from moetext.config.schema import MoEConfig


def check_routing(m: MoEConfig) -> None:
    """Group layout, balancing and scope fields: one ConfigError naming the fields."""
    for name, value, valid in (
        ("aux_loss_scope", m.aux_loss_scope, ("micro_batch", "sequence", "global_batch")),
        ("routing_override", m.routing_override, ("none", "balanced", "random")),
    ):
        if value not in valid:
            raise ConfigError(f"unknown moe.{name} {value!r}; valid: {', '.join(valid)}")
    e, k, g, tg = m.num_experts, m.num_experts_per_tok, m.n_group, m.topk_group
    if g > 1:
        if e % g or e // g < 2:
            raise ConfigError(
                f"moe.n_group={g} must divide moe.num_experts={e} into groups of at least 2 "
                f"experts (a group is scored by its top 2)"
            )
        if tg > g:
            raise ConfigError(f"moe.topk_group={tg} exceeds moe.n_group={g}")
        if tg * (e // g) < k:
            raise ConfigError(
                f"moe.topk_group={tg} groups of {e // g} experts (moe.num_experts={e} / "
                f"moe.n_group={g}) hold fewer than moe.num_experts_per_tok={k} experts"
            )
    elif tg != 1:
        raise ConfigError(f"moe.topk_group={tg} needs moe.n_group > 1 (it is {g})")
    if m.bias_update_rate < 0:
        raise ConfigError(f"moe.bias_update_rate must be >= 0, got {m.bias_update_rate}")
    if m.initial_bias and len(m.initial_bias) != e:
        raise ConfigError(
            f"moe.initial_bias has {len(m.initial_bias)} values for moe.num_experts={e} (one "
            f"per expert, or empty for zeros)"
        )
    if m.routed_scaling_factor <= 0:
        raise ConfigError(
            f"moe.routed_scaling_factor must be positive, got {m.routed_scaling_factor}"
        )
