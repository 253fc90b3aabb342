"""Logical axis names -> PartitionSpec mapping, and `constrain` inside / outside a rules context."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from moetext.sharding import logical

RULES = [
    ("batch", ["data", "fsdp"]),
    ("embed", "fsdp"),
    ("exp", "expert"),
    ("mlp_moe", "tensor"),
    ("heads", "tensor"),
    ("length", None),
]


def test_maps_names_to_axes_and_unmapped_to_none():
    spec = logical.logical_to_mesh_spec(("exp", "embed", "mlp_moe"), RULES)
    assert spec == PartitionSpec("expert", "fsdp", "tensor")
    assert logical.logical_to_mesh_spec(("vocab", None, "length"), RULES) == PartitionSpec(
        None, None, None
    )


def test_multi_axis_rule_becomes_tuple():
    spec = logical.logical_to_mesh_spec(("batch", "length", "embed"), RULES)
    # fsdp is already used by batch, so embed is replicated rather than sharded twice.
    assert spec == PartitionSpec(("data", "fsdp"), None, None)


def test_axis_used_earlier_in_spec_gives_none():
    spec = logical.logical_to_mesh_spec(("heads", "mlp_moe"), RULES)
    assert spec == PartitionSpec("tensor", None)


def test_first_usable_rule_wins_and_falls_back():
    rules = [("embed", "fsdp"), ("embed", "tensor")]
    assert logical.logical_to_mesh_spec(("embed",), rules) == PartitionSpec("fsdp")
    # Second dim cannot reuse fsdp, so the next rule for the same name applies.
    assert logical.logical_to_mesh_spec(("embed", "embed"), rules) == PartitionSpec(
        "fsdp", "tensor"
    )


def test_mesh_axis_filter_drops_absent_axes():
    spec = logical.logical_to_mesh_spec(("batch", "exp"), RULES, mesh_axis_names=("data",))
    assert spec == PartitionSpec("data", None)


def test_constrain_is_identity_without_context():
    x = jnp.arange(6.0).reshape(1, 2, 3)
    assert logical.current() is None
    assert logical.constrain(x, ("batch", "length", "embed")) is x


def test_constrain_applies_named_sharding_in_context():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    x = jnp.arange(12.0).reshape(2, 2, 3)
    f = lambda a: logical.constrain(a, ("batch", "length", "embed")) * 2
    with logical.use_rules(mesh, RULES):
        assert logical.current()[0] is mesh
        jaxpr = jax.make_jaxpr(f)(x)
        y = jax.jit(f)(x)
        with pytest.raises(ValueError, match="rank"):
            logical.constrain(x, ("batch", "embed"))
    assert logical.current() is None
    np.testing.assert_array_equal(y, x * 2)
    # A one-device output sharding normalises away, so read the constraint from the jaxpr.
    cons = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert len(cons) == 1
    assert cons[0].params["sharding"].spec == PartitionSpec(("data", "fsdp"), None, None)
    # A fresh function (trace caches do not key on the context) traced outside: no constraint.
    g = lambda a: logical.constrain(a, ("batch", "length", "embed")) * 2
    assert not [e for e in jax.make_jaxpr(g)(x).eqns if e.primitive.name == "sharding_constraint"]
