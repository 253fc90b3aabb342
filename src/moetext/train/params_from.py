"""checkpoint.load_params_from: a new run's params from another checkpoint's, already sharded.

The source is a run's `checkpoints/<step>/` or a converted checkpoint (`python -m
moetext.convert hf-to-orbax`); only its `state/params` are read (orbax partial restore), each
array straight onto the run's sharding and cast to its param dtype. When the source was saved in
the other layer layout (scan_layers on vs off), the params are restored in the saved layout
with the shardings the run's rules give that layout, then restacked (or unstacked) by the
family's `stack_layers`/`unstack_layers` under jit, onto the run's shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from moetext import checkpoint as checkpoint_lib
from moetext import models
from moetext.config import Config
from moetext.errors import ConfigError
from moetext.orbax_noise import quiet_absent_step_metadata
from moetext.sharding.plan import Plan

Params = nnx.State[Any, Any]


def _scanned(tree: dict[str, Any]) -> bool:
    return "stacks" in tree


def _abstract_params(cfg: Config, plan: Plan) -> Params:
    """ShapeDtypeStructs of cfg's model params, each carrying the plan's sharding."""

    def params() -> Params:
        model = models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
        return nnx.state(model, nnx.Param)

    abstract = jax.eval_shape(params)
    shardings = plan.shardings_for(abstract)
    out: Params = jax.tree.map(
        # jax: ShapeDtypeStruct.__init__ is unannotated.
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),  # type: ignore[no-untyped-call]
        abstract,
        shardings,
    )
    return out


def _restore(state_dir: epath.Path, abstract: Params) -> Params:
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    restored = ocp.PyTreeCheckpointer().restore(
        state_dir,
        args=ocp.args.PyTreeRestore(
            item={"params": abstract},
            restore_args={"params": restore_args},
            partial_restore=True,
        ),
    )
    params: Params = restored["params"]
    return params


def load_params(cfg: Config, plan: Plan, directory: str) -> Params:
    """The params of `directory` for a run of `cfg` on `plan` (sharded, in param_dtype)."""
    d = epath.Path(directory)
    where = f"checkpoint.load_params_from={directory}"
    quiet_absent_step_metadata()
    if not d.exists():
        raise ConfigError(f"{where}: the directory does not exist")
    saved = checkpoint_lib.read_meta_config(d)
    bad = checkpoint_lib.shape_mismatches(saved, cfg, "the checkpoint", "this run")
    if bad:
        raise ConfigError(f"{where} does not fit this run's model: " + "; ".join(bad))
    meta = ocp.PyTreeCheckpointer().metadata(d / "state").item_metadata
    tree = meta.tree if hasattr(meta, "tree") else meta
    if "params" not in tree:
        raise ConfigError(f"{where}: {d / 'state'} holds no params")
    saved_scanned = _scanned(tree["params"])
    target = _abstract_params(cfg, plan)
    if saved_scanned == cfg.model.scan_layers:
        return _restore(d / "state", target)
    family = models.get_family(cfg.model.family)
    relayout = family.stack_layers if cfg.model.scan_layers else family.unstack_layers
    if relayout is None:
        raise ConfigError(
            f"{where} was saved with scan_layers={saved_scanned}; model family "
            f"{family.name!r} cannot change the layer layout: set model.scan_layers="
            f"{str(saved_scanned).lower()}"
        )
    saved_cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, scan_layers=saved_scanned)
    )
    restored = _restore(d / "state", _abstract_params(saved_cfg, plan))
    out_shardings = nnx.to_pure_dict(jax.tree.map(lambda x: x.sharding, target))

    def convert(pure: dict[str, Any]) -> dict[str, Any]:
        return relayout(pure, cfg.model)

    pure = jax.jit(convert, out_shardings=out_shardings)(nnx.to_pure_dict(restored))
    nnx.replace_by_pure_dict(target, pure)
    return target
