"""The embedded corpus: stdlib docstrings as documents, prepared once per data dir and vocab size,
with concurrent first uses waiting for a single preparation."""

import os
import textwrap
from concurrent.futures import ThreadPoolExecutor

import tensorflow_datasets as tfds

from fake_devices import run_worker
from moetext.data import corpus
from moetext.data.tokenizer import load_tokenizer

SOURCE = textwrap.dedent('''
    """Module doc."""
    import os

    def f():
        """f doc."""
        def inner():
            """not included: a function's body is not visited"""

    if os.name:
        class C:
            """C doc."""
            def m(self):
                """m doc."""
            class D:
                def undocumented(self): pass
''')


def test_module_document_gathers_docstrings_under_qualified_names():
    assert corpus.module_document(SOURCE.encode(), "pkg.mod") == (
        "# pkg.mod\n\nModule doc.\n\n## pkg.mod.f\n\nf doc.\n\n## pkg.mod.C\n\nC doc.\n\n"
        "## pkg.mod.C.m\n\nm doc."
    )
    assert corpus.module_document(b"x = 1\n", "m") is None
    assert corpus.module_document(b"def (:\n", "m") is None


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETEXT_DATA_DIR", str(tmp_path / "m"))
    assert corpus.default_data_dir() == str(tmp_path / "m")
    monkeypatch.delenv("MOETEXT_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus.default_data_dir() == str(tmp_path / "xdg" / "moetext" / "data")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert corpus.default_data_dir() == str(tmp_path / "home" / ".cache" / "moetext" / "data")


def test_ensure_prepares_once_then_hits_the_cache(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MOETEXT_DATA_DIR", str(tmp_path))
    dataset_dir, tok_path = corpus.ensure_python_docs(vocab_size=512)
    assert dataset_dir == str(tmp_path / "python_docs" / corpus.python_version())
    assert tok_path == os.path.join(dataset_dir, "tokenizer-v512.model")
    assert capsys.readouterr().err.count("preparing the embedded corpus") == 1
    builder = tfds.builder_from_directory(dataset_dir)
    assert builder.info.splits["train"].num_examples > 400
    assert builder.info.splits["eval"].num_examples > 0
    text = builder.as_data_source("train")[0]["text"].decode()
    tok = load_tokenizer(tok_path)
    assert tok.vocab_size == 512 and tok.decode(tok.encode(text)) == text
    # The ChatML pieces are reserved (single tokens), so a model pretrained on this corpus
    # can be fine-tuned on chats with the built-in template.
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.token_id("<|im_start|>") in ids[:2]  # after sentencepiece's dummy prefix "▁"
    assert ids[-1] == tok.token_id("<|im_end|>")

    mtime = os.stat(os.path.join(dataset_dir, "dataset_info.json")).st_mtime_ns
    assert corpus.ensure_python_docs(vocab_size=512) == (dataset_dir, tok_path)
    assert capsys.readouterr().err == ""
    assert os.stat(os.path.join(dataset_dir, "dataset_info.json")).st_mtime_ns == mtime
    # Another vocab size: a tokenizer beside the same dataset; large ones are capped.
    _, big = corpus.ensure_python_docs(vocab_size=100_000)
    assert big == os.path.join(dataset_dir, f"tokenizer-v{corpus.VOCAB_CAP}.model")
    assert os.stat(os.path.join(dataset_dir, "dataset_info.json")).st_mtime_ns == mtime
    assert capsys.readouterr().err.startswith(f"moetext: preparing a {corpus.VOCAB_CAP}-piece")
    # Below what the corpus needs: its smallest tokenizer (the model check then names it).
    _, smallest = corpus.ensure_python_docs(vocab_size=300)
    assert 300 < load_tokenizer(smallest).vocab_size < 400
    assert not os.path.exists(os.path.join(dataset_dir, "tokenizer-v300.model"))
    # A copy from an older CORPUS_FORMAT (here: the code moves one format on) is rebuilt,
    # tokenizers included: the tokenizer the old copy had is trained again, not assumed.
    monkeypatch.setattr(corpus, "CORPUS_FORMAT", corpus.CORPUS_FORMAT + 1)
    assert corpus.ensure_python_docs(vocab_size=512) == (dataset_dir, tok_path)
    assert load_tokenizer(tok_path).vocab_size == 512


def test_concurrent_first_uses_prepare_once(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETEXT_DATA_DIR", str(tmp_path))
    worker = "tests.data.corpus_worker"
    with ThreadPoolExecutor(2) as pool:  # two processes at once, both finding nothing prepared
        runs = [pool.submit(run_worker, worker, timeout_s=120) for _ in range(2)]
    outs = [run.result() for run in runs]
    assert outs[0]["paths"] == outs[1]["paths"]
    assert sum(out["stderr"].count("preparing the embedded corpus") for out in outs) == 1
    assert sorted(os.listdir(tmp_path)) == [".python_docs.lock", "python_docs"]
