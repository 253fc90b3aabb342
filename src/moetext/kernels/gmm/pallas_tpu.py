"""Backend "pallas_tpu": the Pallas Mosaic TPU grouped matmul (kernels/pallas/gmm_kernels.py).

The kernel bodies, their schedule and tilings are in `moetext.kernels.pallas`; this backend
holds the settings they compile with (interpret mode, chip) and maps the protocol's `GmmCall`
onto them. The FP8 Pallas kernels are paired with it by the quantization room
(kernels/quant/scaled_kernels.py).

Off TPU the kernels run in Pallas interpret mode; `interpret=pltpu.InterpretParams()` selects
the TPU-faithful interpreter (uninitialised VMEM is NaN, DMAs and revisits modelled).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
from jax import Array

from moetext.kernels.gmm.backend import GmmBackend, GmmCall, register
from moetext.kernels.pallas import gmm_kernels
from moetext.kernels.pallas import tiling as tiling_lib


@dataclasses.dataclass(frozen=True)
class PallasTpuBackend(GmmBackend):
    """interpret: None = interpret unless jax's default backend is TPU; True/False; or a
    `pltpu.InterpretParams` for the TPU-faithful interpreter. Compiling ahead of time for a TPU
    topology from a CPU host needs interpret=False (see `for_device`).
    chip: 'v5e' | 'v5p' | 'v6e' | 'tpu7x' for default tiles and VMEM limits; None = the local
    TPU's generation, else tiling.FALLBACK_CHIP.
    """

    interpret: Any = None
    chip: str | None = None
    name: ClassVar[str] = "pallas_tpu"

    @classmethod
    def for_device(cls, device: jax.Device) -> PallasTpuBackend:
        """Compiles for `device` (e.g. a topology device for AOT compiles)."""
        on_tpu = device.platform == "tpu"
        chip = tiling_lib.chip_from_device_kind(device.device_kind) if on_tpu else None
        return cls(interpret=not on_tpu, chip=chip)

    def gmm(
        self,
        lhs: Array,
        rhs: Array,
        group_sizes: Array,
        call: GmmCall,
        existing_out: Array | None = None,
    ) -> Array:
        """Beyond the protocol: rows outside the local groups keep `existing_out` [M, N] (an
        aliased, in-place initial buffer) instead of zeros."""
        return gmm_kernels.gmm(
            lhs,
            rhs,
            group_sizes,
            transpose_rhs=call.transpose_rhs,
            existing_out=existing_out,
            rows_covered=call.rows_covered and existing_out is None,
            **self.kernel_options(call),
        )

    def tgmm(self, lhs: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
        opts = self.kernel_options(call)
        return gmm_kernels.tgmm(lhs, rhs, group_sizes, num_groups=call.local_groups, **opts)

    def kernel_options(self, call: GmmCall) -> dict[str, Any]:
        """The keywords every kernels/pallas grouped matmul takes, for `call` on this backend
        (the FP8 kernels of quant/scaled_kernels.py pass them too)."""
        return dict(
            preferred_element_type=call.out_dtype,
            group_offset=call.group_offset,
            tiling=call.tiling,
            interpret=self.interpret,
            chip=self.chip,
        )


register("pallas_tpu", PallasTpuBackend)
