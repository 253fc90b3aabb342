"""Orbax checkpoints of the whole train state, with automatic resume.

Layout: <run_dir>/checkpoints/<step>/{state, meta}. `state` holds params, optimizer state,
step and RNG (sharded arrays, restored straight onto the run's shardings); `meta` holds the
data position and the config fingerprint. Orbax writes into a temporary directory and renames
it on completion, so `latest_step()` only ever sees complete checkpoints.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from moetext.config import CheckpointConfig


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: str | os.PathLike):
        self.cfg = cfg
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        return self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restores onto the shardings and dtypes of `abstract_state` (ShapeDtypeStructs)."""
        restored = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return restored.state, dict(restored.meta)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )
