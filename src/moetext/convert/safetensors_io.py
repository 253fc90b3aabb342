"""Read and write Hugging Face safetensors checkpoints, one tensor at a time.

Reading memory-maps each file (`np.memmap`): a tensor is a read-only view of the file's pages,
so reading the whole checkpoint adds no anonymous memory. A checkpoint is one
`model.safetensors` or several shards listed by `model.safetensors.index.json`
(`weight_map`: tensor name -> file). The format: 8 bytes little-endian header length, a JSON
header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the
raw little-endian bytes (offsets relative to the end of the header).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from moetext.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # block-scaled weights (convert/fp8.py)
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path}: not a safetensors file (shorter than its 8-byte header)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not a safetensors file (unreadable header: {e})") from e
    return header, 8 + n


class SafetensorsReader:
    """Tensors of an HF checkpoint directory by name, as read-only memory-mapped arrays."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(f"Hugging Face checkpoint directory {self.directory} does not exist")
        index = self.directory / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE).exists():
            files = [SINGLE]
        else:
            raise ConfigError(
                f"{self.directory} has neither {SINGLE} nor {INDEX} (a safetensors checkpoint)"
            )
        self._where: dict[str, tuple[Path, dict[str, Any], int]] = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise ConfigError(f"{index} names shard {name}, which is not in {self.directory}")
            header, start = _header(path)
            for key, info in header.items():
                if key != "__metadata__":
                    self._where[key] = (path, info, start)
        if index.exists():
            missing = sorted(k for k, f in weight_map.items() if k not in self._where)
            if missing:
                raise ConfigError(f"{index} lists tensors its shards do not hold: {missing[:5]}")

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ConfigError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        path, info, start = self._where[name]
        if info["dtype"] not in _DTYPES:
            raise ConfigError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ConfigError(f"tensor {name!r} in {path}: {end - begin} bytes for {shape}")
        if not shape or end == begin:
            return np.fromfile(path, dtype, int(np.prod(shape)), offset=start + begin).reshape(
                shape
            )
        return np.memmap(path, dtype, "r", offset=start + begin, shape=shape)

    def dtype_name(self, name: str) -> str:
        return str(self._where[name][1]["dtype"])


def write(
    directory: str | Path,
    tensors: Iterator[tuple[str, np.ndarray]],
    *,
    max_shard_bytes: int,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Writes (name, array) pairs in order into shards of at most `max_shard_bytes` (a tensor
    larger than that gets a shard of its own), plus model.safetensors.index.json when there is
    more than one shard. Arrays are consumed one at a time. Returns the files written."""
    directory = Path(directory)
    pending: list[tuple[str, np.ndarray]] = []
    shards: list[list[tuple[str, Path]]] = []
    tmp_files: list[Path] = []
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if not pending:
            return
        path = directory / f".shard-{len(tmp_files):05d}.tmp"
        _write_file(path, pending, metadata)
        tmp_files.append(path)
        shards.append([(name, path) for name, _ in pending])
        pending, size = [], 0

    for name, array in tensors:
        a = np.ascontiguousarray(array)
        if pending and size + a.nbytes > max_shard_bytes:
            flush()
        pending.append((name, a))
        size += a.nbytes
    flush()
    n = len(tmp_files)
    out = (
        [directory / SINGLE]
        if n == 1
        else [directory / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for tmp, final, names in zip(tmp_files, out, shards, strict=True):
        tmp.rename(final)
        total += final.stat().st_size
        weight_map.update({name: final.name for name, _ in names})
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        out.append(directory / INDEX)
    return out


def _write_file(
    path: Path, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str] | None
) -> None:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, a in tensors:
        if a.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, a in tensors:
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
