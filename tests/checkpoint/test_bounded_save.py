"""bounded_save: chunk-aligned boxes tile every array exactly, the handler never has more than
`slots` writes in flight, and what it writes the stock orbax handler reads back equal."""

from __future__ import annotations

import asyncio
import itertools
import math

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moetext.checkpoint import bounded_save
from moetext.checkpoint.bounded_save import BoundedNumpyHandler, chunk_boxes


@pytest.mark.parametrize(
    ("shape", "chunks", "max_bytes"),
    [
        ((64, 256, 512), (8, 256, 512), 32 * 2**20),  # whole rows of chunks, several per box
        ((64, 256, 512), (8, 64, 512), 2**18),  # one chunk-row too big: split the next axis
        ((10, 7, 5), (3, 2, 5), 40),  # edges cut chunks on two axes; a chunk > max_bytes
        ((7,), (3,), 8),
        ((), (), 1),
    ],
)
def test_boxes_tile_the_array_in_whole_chunks(shape, chunks, max_bytes):
    itemsize = 2
    seen = np.zeros(shape, np.int32)
    chunk_bytes = math.prod(chunks) * itemsize
    for box in chunk_boxes(shape, chunks, itemsize, max_bytes):
        seen[box] += 1
        sub = seen[box].shape
        assert math.prod(sub) * itemsize <= max(max_bytes, chunk_bytes), (box, sub)
        for s, c, n in zip(box, chunks, shape, strict=True):
            start, stop, _ = s.indices(n)
            assert start % c == 0 and (stop % c == 0 or stop == n), (box, chunks)
    assert (seen == 1).all()


def test_no_boxes_for_an_empty_array_and_a_clear_error_for_a_wrong_grid():
    assert list(chunk_boxes((4, 0), (4, 1), 2, 8)) == []
    with pytest.raises(ValueError, match=r"chunk shape \(4,\) does not fit array shape \(4, 4\)"):
        list(chunk_boxes((4, 4), (4,), 2, 8))
    with pytest.raises(ValueError, match="box_bytes=0 and slots=2"):
        BoundedNumpyHandler(box_bytes=0, slots=2)


def test_saves_what_the_stock_handler_reads_back_with_at_most_slots_writes_in_flight(
    tmp_path, monkeypatch
):
    rng = np.random.default_rng(0)
    tree = {
        "experts": rng.standard_normal((16, 64, 96), np.float32).astype(ml_dtypes.bfloat16),
        "norm": rng.standard_normal((96,), np.float32),
        "odd": rng.standard_normal((13, 7, 5), np.float32),
        "scalar": np.asarray(3.0, np.float32),
    }
    in_flight, most = 0, 0
    write = bounded_save.ts.TensorStore.write

    async def counted(self, *args, **kwargs):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            await asyncio.sleep(0.001)  # let the other arrays' coroutines run meanwhile
            return await write(self, *args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(bounded_save.ts.TensorStore, "write", counted)
    writer = BoundedNumpyHandler(box_bytes=4096, slots=2)
    registry = ocp.type_handlers.create_type_handler_registry((np.ndarray, writer))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_ocdbt=False)
    # Small chunks, so that every array but the scalar is written in many boxes.
    save_args = {k: ocp.SaveArgs(chunk_byte_size=1024) for k in tree}
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=ocp.args.PyTreeSave(tree, save_args=save_args))
    monkeypatch.undo()
    assert most == 2, most  # both slots used, never more

    restore = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in tree}
    got = ocp.PyTreeCheckpointer().restore(
        tmp_path / "ckpt", args=ocp.args.PyTreeRestore(restore_args=restore)
    )
    for k, want in tree.items():
        assert got[k].dtype == want.dtype and np.array_equal(got[k], want), k
    chunk_files = itertools.chain.from_iterable(
        (tmp_path / "ckpt" / k).glob("*.*") for k in ("experts", "odd")
    )
    assert sum(1 for f in chunk_files if not f.name.startswith(".")) > 16


def test_pins_glibcs_mmap_threshold_where_glibc_is_the_c_library():
    # True on glibc (this project's CI), False and a no-op elsewhere; calling it twice is fine.
    import platform

    is_glibc = platform.libc_ver()[0] == "glibc"
    assert bounded_save.return_large_frees_to_os() is is_glibc
    assert bounded_save.return_large_frees_to_os() is is_glibc
