"""check_config and shape_mismatches follow each field's declaration (config/fields.py), on the
fields of the actual instances: a section's subclass (a family's own config) is checked by what
its extra fields declare."""

import dataclasses

import pytest

from moetext import config
from moetext.checkpoint import CheckpointError, check_config, shape_mismatches
from moetext.config import Config, ModelConfig, MoEConfig, families, fields


@dataclasses.dataclass(frozen=True)
class FamilyModel(ModelConfig):
    family: str = fields.shapes_params("config_check_test")
    """A family whose model section has fields of its own."""
    latent_dim: int = fields.shapes_params(16)
    """A param shape only this family has."""
    bias_update_rate: float = fields.resume_safe(0.001)
    """A hyperparameter only this family has."""
    mtp_depth: int = fields.must_match(0)
    """Changes the objective, not a param shape."""


families.register_family_config("config_check_test", FamilyModel, MoEConfig, replace=True)


def _cfg(**model) -> Config:
    return Config(model=FamilyModel(**model))


def test_resume_follows_the_subclass_fields_declarations():
    saved = config.to_dict(_cfg())
    assert check_config(saved, _cfg(bias_update_rate=0.01), "c") == [
        "model.bias_update_rate: 0.001 -> 0.01"
    ]
    for change, line in [
        ({"latent_dim": 32}, "model.latent_dim: 16 -> 32"),
        ({"mtp_depth": 1}, "model.mtp_depth: 0 -> 1"),
    ]:
        with pytest.raises(CheckpointError, match=line):
            check_config(saved, _cfg(**change), "c")


def test_a_field_the_saved_config_lacks_counts_as_its_default():
    saved = config.to_dict(_cfg())
    for name in ("latent_dim", "bias_update_rate", "mtp_depth"):  # saved before they existed
        del saved["model"][name]
    assert check_config(saved, _cfg(), "c") == []
    with pytest.raises(CheckpointError, match="model.latent_dim: 16 -> 8"):
        check_config(saved, _cfg(latent_dim=8), "c")


def test_shape_mismatches_name_only_param_fields_of_either_side():
    a, b = _cfg(latent_dim=8, mtp_depth=1, bias_update_rate=1.0), _cfg()
    assert shape_mismatches(a, b, "the checkpoint", "this run") == [
        "model.latent_dim: the checkpoint has 8, this run 16"
    ]
    qwen = shape_mismatches(Config(), b, "x", "y")
    assert "model.family: x has 'qwen3_moe', y 'config_check_test'" in qwen
    assert "model.qk_norm: x has True, y no such field" in qwen
    assert "model.latent_dim: x has no such field, y 16" in qwen


def test_section_options_and_must_match_fields_as_before():
    saved = config.to_dict(Config())
    recipe = Config().replace(
        kernels=config.KernelsConfig(quantization="fp8_blockwise", recipe={"block_size": 64})
    )
    assert check_config(saved, recipe, "c") == [
        "kernels.quantization: 'none' -> 'fp8_blockwise'",
        "kernels.recipe: {} -> {'block_size': 64}",
    ]
    capacity = Config().replace(moe=config.MoEConfig(dispatch="capacity"))
    with pytest.raises(CheckpointError, match="moe.dispatch: 'dropless' -> 'capacity'"):
        check_config(saved, capacity, "c")
