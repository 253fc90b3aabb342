"""What a family tells checkpoint conversion about Hugging Face checkpoints: its `HfAdapter`.

A family with an adapter (`ModelFamily.hf`) converts both ways with `moetext.convert`; the
adapter says which config.json `model_type` values it reads, maps config.json to its config
sections and back, lists every parameter with the HF tensors it is made of (`Tensor`), may
fit the config to what the checkpoint stores (`fit_config`) and may preprocess the stored
tensors by wrapping the reader (`wrap_source`; block-scaled FP8 weights are dequantized before
it, by convert/fp8.py, for every family). convert/ holds what every family shares:
safetensors I/O, staging and the orbax writes; it reaches a family's adapter only through
`models.family_for_hf` / `models.get_family`.

HF stores torch Linear weights as [out, in]; moetext stores [in, out] with heads split out
(w_q [D, N, H], w_o [N, H, D]) and experts stacked (w_gate [E, D, F]). Every `Tensor.kind` is a
transpose/reshape/stack, so hf -> moetext -> hf is bit-exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from moetext.config.schema import ModelConfig, MoEConfig
from moetext.errors import ConfigError

ParamPath = tuple[str | int, ...]
Kind = Literal["same", "linear", "heads_in", "heads_out", "experts", "bias_heads"]
HF_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One moetext parameter and the HF tensors it is made of.

    kind says how: same (identity), linear (torch [out, in] <-> [in, out]), heads_in (q/k/v:
    [n*h, d] <-> [d, n, h]), heads_out (o: [d, n*h] <-> [n, h, d]), experts (E torch
    [out, in] tensors <-> one [E, in, out]), bias_heads (q/k/v bias: [n*h] <-> [n, h])."""

    path: ParamPath
    """Where it lives in the unscanned model's nnx.State (its nnx.Param or ModelState leaf)."""
    hf_names: tuple[str, ...]
    """The HF tensors, in order (E of them for stacked experts)."""
    shape: tuple[int, ...]
    """The moetext shape."""
    kind: Kind
    item: Literal["params", "model_state"] = "params"
    """Which part of the model state it is: an nnx.Param (saved in the dtype conversion asks
    for), or a models.ModelState variable (a router's selection bias, e.g. DeepSeek-V3's
    `e_score_correction_bias`: always float32, saved in the checkpoint's `model_state`)."""
    copies: tuple[str, ...] = ()
    """HF tensors that store this one again (kind same only; DeepSeek-V3's MTP layers keep
    copies of the embedding and the head): import checks each equals it, export writes each."""

    def __post_init__(self) -> None:
        assert not self.copies or self.kind == "same", "copies of a one-tensor identity only"

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of each of the HF tensors."""
        s = self.shape
        if self.kind == "same":
            return s
        if self.kind == "linear":
            return (s[1], s[0])
        if self.kind == "heads_in":
            return (s[1] * s[2], s[0])
        if self.kind == "heads_out":
            return (s[2], s[0] * s[1])
        if self.kind == "bias_heads":
            return (s[0] * s[1],)
        return (s[2], s[1])  # experts

    def to_moetext(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        x = np.asarray(parts[0])
        if self.kind == "same":
            return x
        if self.kind == "bias_heads":
            return x.reshape(self.shape)
        if self.kind == "linear":
            return np.ascontiguousarray(x.T)
        if self.kind in ("heads_in", "heads_out"):
            return np.ascontiguousarray(x.T.reshape(self.shape))
        return np.stack([np.asarray(p).T for p in parts])

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        x = np.asarray(value)
        if self.kind == "same":
            return [x]
        if self.kind == "experts":
            return [np.ascontiguousarray(e.T) for e in x]
        if self.kind == "bias_heads":
            return [x.reshape(self.hf_shape)]
        flat = (self.hf_shape[1], self.hf_shape[0])  # the moetext side as [in, out]
        return [np.ascontiguousarray(x.reshape(flat).T)]


class TensorSource(Protocol):
    """Stored HF tensors by name (convert.safetensors_io.SafetensorsReader, or an adapter's
    preprocessing view of one)."""

    @property
    def directory(self) -> Any: ...

    def names(self) -> list[str]: ...

    def get(self, name: str) -> np.ndarray: ...


def _same_source(source: TensorSource) -> TensorSource:
    return source


@dataclasses.dataclass(frozen=True)
class Fitted:
    """The config of what a checkpoint actually holds (`HfAdapter.fit_config`)."""

    model: ModelConfig
    moe: MoEConfig
    warnings: tuple[str, ...] = ()
    """One line each, printed by the converter (e.g. a part of the checkpoint left out)."""


def _fits(model: ModelConfig, moe: MoEConfig, names: Collection[str]) -> Fitted:
    return Fitted(model, moe)


@dataclasses.dataclass(frozen=True)
class HfAdapter:
    """A family's Hugging Face checkpoint mapping (see the module docstring)."""

    model_types: tuple[str, ...]
    """The config.json `model_type` values this family reads (and may write)."""
    config_from_hf: Callable[[Mapping[str, Any]], tuple[ModelConfig, MoEConfig, str]]
    """config.json (either spelling the family accepts) -> (model, moe, stored dtype); a
    ConfigError naming the field for anything the family cannot represent."""
    config_to_hf: Callable[[ModelConfig, MoEConfig, str], dict[str, Any]]
    """(model, moe, dtype) -> config.json; a ConfigError naming the field for a config that no
    HF architecture of the family describes exactly."""
    tensor_map: Callable[[ModelConfig, MoEConfig], list[Tensor]]
    """Every parameter of the unscanned model (and every model-state variable HF stores) with
    the HF tensors it is made of."""
    wrap_source: Callable[[TensorSource], TensorSource] = _same_source
    """The stored tensors as the tensor map reads them: identity, or a view that preprocesses
    (the converter itself already dequantizes block-scaled FP8 weights, convert/fp8.py)."""
    fit_config: Callable[[ModelConfig, MoEConfig, Collection[str]], Fitted] = _fits
    """(config_from_hf's model and moe, the stored tensor names) -> the config of what the
    checkpoint holds, where config.json alone does not say (DeepSeek-V3: num_nextn_predict_layers
    MTP layers that transformers never saves are turned off, with a warning)."""


def hf_dtype(hf: Mapping[str, Any]) -> str:
    """The stored dtype config.json names (`dtype`, or `torch_dtype` in released checkpoints)."""
    name = str(next((hf[k] for k in ("dtype", "torch_dtype") if k in hf), "float32"))
    if name not in HF_DTYPES:
        raise ConfigError(f"config.json dtype {name!r} is not one of {', '.join(HF_DTYPES)}")
    return name
