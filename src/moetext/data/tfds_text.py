"""Write a TFDS dataset of {"text": str} records (array_record files) from a generator per split
(or of other text features: chat data is {"messages": JSON text, "source": "file:line"}).

The builder class is made on the fly (`skip_registration=True`): it never enters the TFDS
catalog, and the dataset is read back by path (`tfds.builder_from_directory`), so no TFDS
name lookup or download can happen.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import tempfile
import types
import unittest.mock
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# split name -> (key, text) pairs, or (key, {feature: text}); keys are unique across the dataset.
Generate = Callable[[str], Iterator[tuple[str, str | dict[str, str]]]]


def builder_class(
    name: str,
    version: str,
    splits: Sequence[str],
    generate: Generate,
    features: Sequence[str] = ("text",),
) -> Any:
    """A GeneratorBasedBuilder for {feature: Text} whose split S holds generate(S) (a plain
    string is the one feature of a single-feature dataset)."""
    import tensorflow_datasets as tfds

    dataset_name, dataset_version = name, version

    # tensorflow_datasets is untyped (no py.typed): the base class is Any to mypy (misc), which
    # then checks skip_registration against object.__init_subclass__ (call-arg).
    class LocalText(tfds.core.GeneratorBasedBuilder, skip_registration=True):  # type: ignore[misc,call-arg]
        VERSION = tfds.core.Version(dataset_version)
        name = dataset_name
        # TFDS looks for download checksums beside the builder's source file; for a class
        # in a package that lookup imports importlib_resources (not installed). None: none.
        code_path = None

        def _info(self) -> tfds.core.DatasetInfo:
            return tfds.core.DatasetInfo(
                builder=self,
                description="Local text prepared by moetext.data.prepare.",
                features=tfds.features.FeaturesDict({f: tfds.features.Text() for f in features}),
            )

        def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
            return {s: self._generate_examples(s) for s in splits}

        def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, str]]]:
            for key, text in generate(split):
                yield key, text if isinstance(text, dict) else {features[0]: text}

    return LocalText


def write(
    data_dir: str,
    name: str,
    version: str,
    splits: Sequence[str],
    generate: Generate,
    *,
    quiet: bool = False,
    features: Sequence[str] = ("text",),
) -> str:
    """Writes DATA_DIR/NAME/VERSION (TFDS builds in an incomplete.* dir and renames it at the
    end); returns that directory. Every split must yield at least one record."""
    builder = builder_class(name, version, splits, generate, features)(
        data_dir=data_dir, file_format="array_record"
    )
    # The download dir is unused, but TFDS creates it: keep it out of data_dir.
    with tempfile.TemporaryDirectory(prefix="moetext-tfds-downloads-") as downloads:
        with _quiet(quiet), _local_spill_files():
            builder.download_and_prepare(download_dir=downloads)
    return str(builder.data_dir)


class _LocalGFile:
    """The part of tf.io.gfile that TFDS's shuffler uses, on local files."""

    @staticmethod
    def GFile(path: Any, mode: str) -> Any:  # noqa: N802  (tf's name)
        return open(os.fspath(path), mode)

    @staticmethod
    def exists(path: Any) -> bool:
        return os.path.exists(os.fspath(path))

    @staticmethod
    def remove(path: Any) -> None:
        os.remove(os.fspath(path))


class _NeverRaised(Exception):
    pass


@contextlib.contextmanager
def _local_spill_files() -> Iterator[None]:
    """Lets TFDS write splits larger than its 1 GB shuffle buffer without TensorFlow.

    TFDS's shuffler keeps a split's serialized records in memory up to 1 GB, then spills them
    to ~1000 bucket files through tf.io.gfile, which needs TensorFlow (not a dependency
    here). Without TensorFlow, those bucket files go through plain open() instead.
    """
    from tensorflow_datasets.core import shuffle

    if importlib.util.find_spec("tensorflow") is not None or not hasattr(shuffle, "tf"):
        yield
        return
    shim = types.SimpleNamespace(
        io=types.SimpleNamespace(gfile=_LocalGFile),
        errors=types.SimpleNamespace(ResourceExhaustedError=_NeverRaised),
    )
    with unittest.mock.patch.object(shuffle, "tf", shim):
        yield


@contextlib.contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    """Silences TFDS's stdout messages (they name the builder's temporary dir) and, when
    quiet, its progress bars (tqdm, on stderr)."""
    from tensorflow_datasets.core.utils import tqdm_utils

    was = getattr(tqdm_utils, "_active", True)
    tqdm_utils.display_progress_bar(was and not quiet)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        tqdm_utils.display_progress_bar(was)
