"""Device meshes from a resolved preset, and multi-process start-up.

Each mesh axis has an ICI size (within a slice) and a DCN size (across slices); the mesh axis
is their product, DCN-major, so collectives over an axis with DCN size 1 never leave a slice.
Axes are created `Auto` (GSPMD propagation): layers only constrain, XLA places the rest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from moetext.config.presets import Preset, axis_sizes
from moetext.config.schema import DistributedConfig
from moetext.errors import ConfigError

# Set by launchers that start one process per host; any of them means "multi-process".
_LAUNCHER_ENV = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def make_mesh(preset: Preset, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh over `devices` (default: all), axes named and ordered as in the preset."""
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = axis_sizes(preset, len(devices))
    names = preset.mesh_axes
    ici_shape = [ici[a] for a in names]
    dcn_shape = [dcn[a] for a in names]
    if math.prod(dcn_shape) == 1:
        arr = _device_grid(ici_shape, devices)
    elif hasattr(devices[0], "slice_index"):
        arr = mesh_utils.create_hybrid_device_mesh(
            ici_shape, dcn_shape, devices, allow_split_physical_axes=True
        )
    else:
        arr = _sliced_grid(ici_shape, dcn_shape, devices)
    return Mesh(arr, names, axis_types=(AxisType.Auto,) * len(names))


def _device_grid(shape: list[int], devices: list[jax.Device]) -> np.ndarray:
    # On TPU the physical torus order matters (neighbours on an axis share a link); other
    # platforms, and shapes mesh_utils cannot map, keep device order.
    if devices[0].platform == "tpu":
        try:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            pass
    return np.array(devices, dtype=object).reshape(shape)


def _sliced_grid(
    ici_shape: list[int], dcn_shape: list[int], devices: list[jax.Device]
) -> np.ndarray:
    # Devices without a slice_index (CPU, tests): consecutive blocks of devices are the slices.
    # Each axis becomes (dcn, ici) with dcn major, the same layout as the TPU hybrid mesh.
    n = len(ici_shape)
    grid = np.array(devices, dtype=object).reshape(dcn_shape + ici_shape)
    order = [i for pair in zip(range(n), range(n, 2 * n), strict=True) for i in pair]
    return grid.transpose(order).reshape([d * i for d, i in zip(dcn_shape, ici_shape, strict=True)])


# --- multi-process ---------------------------------------------------------------------------


def wants_distributed(cfg: DistributedConfig) -> bool:
    if cfg.initialize == "never":
        return False
    if cfg.initialize == "always":
        return True
    if (cfg.num_processes or 1) > 1:
        return True
    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        return True
    return any(os.environ.get(k) for k in _LAUNCHER_ENV)


def initialize_distributed(cfg: DistributedConfig) -> bool:
    """Calls jax.distributed.initialize when the config or environment says the job spans
    several processes. Must run before anything touches devices. Returns whether it did."""
    if not wants_distributed(cfg):
        return False
    num = cfg.num_processes or _env_int("JAX_NUM_PROCESSES")
    pid = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    if num is not None and pid is not None and not 0 <= pid < num:
        raise ConfigError(f"distributed.process_id={pid} is outside [0, num_processes={num})")
    if jax.config.jax_platforms in ("cpu", None) and (num or 1) > 1:
        # The CPU client has no cross-process collectives unless one is chosen.
        # jax: Config.update is unannotated.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address,
        num_processes=num,
        process_id=pid,
        initialization_timeout=cfg.initialization_timeout_s,
    )
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None
