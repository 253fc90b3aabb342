"""prepare: local files -> a TFDS dataset (train/eval) + tokenizer, read back the way a run
reads it; determinism, re-runs, overwrite, and every input error before anything is written."""

import gzip
import json
import os
import subprocess
import sys

import grain
import pytest
import tensorflow_datasets as tfds

from moetext.data.prepare import main, prepare
from moetext.data.tokenizer import find_tokenizer, load_tokenizer

FAST = {"with_tokenizer": False, "quiet": True}  # tests about documents skip the tokenizer


def _texts(dataset_dir, split):
    source = tfds.builder_from_directory(dataset_dir).as_data_source(split)
    return [r["text"].decode() for r in source]


def _all_texts(result):
    """Every document of the dataset, sorted."""
    splits = [s for s, n in result.stats.documents.items() if n]
    return sorted(t for s in splits for t in _texts(result.dataset_dir, s))


def test_jsonl_to_dataset_and_tokenizer_read_back_with_grain(tmp_path, paragraphs, write_jsonl):
    src = write_jsonl(tmp_path / "in" / "a.jsonl", paragraphs)
    result = prepare([str(src)], "docs", str(tmp_path / "data"), eval_fraction=0.1, vocab_size=400)
    assert result.prepared and result.dataset_dir == str(tmp_path / "data" / "docs" / "1.0.0")
    stats = result.stats
    assert stats.documents["train"] + stats.documents["eval"] == len(paragraphs)
    assert stats.documents["eval"] > 0 and stats.characters["eval"] > 0
    assert stats.characters["train"] + stats.characters["eval"] == sum(map(len, paragraphs))
    assert _all_texts(result) == sorted(paragraphs)

    train = tfds.builder_from_directory(result.dataset_dir).as_data_source("train")
    ds = grain.MapDataset.source(train)
    assert len(ds) == stats.documents["train"] and isinstance(ds[0]["text"], bytes)

    assert result.tokenizer_path == find_tokenizer(result.dataset_dir)
    assert os.path.basename(result.tokenizer_path) == "tokenizer.model"
    assert load_tokenizer(result.tokenizer_path).vocab_size == 400
    record = json.load(open(os.path.join(result.dataset_dir, "moetext_prepare.json")))
    assert record["inputs"][0]["path"] == str(src) and record["inputs"][0]["size"] > 0
    assert record["options"]["vocab_size"] == 400 and record["stats"]["documents"]["eval"] > 0
    assert sorted(os.listdir(tmp_path / "data")) == ["docs"]  # no downloads/ or staging left
    assert sorted(os.listdir(tmp_path / "data" / "docs")) == ["1.0.0"]


def test_input_formats_directories_and_globs(tmp_path, write_jsonl):
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first file\n\nstill the first file\n")
    (root / "sub" / "b.txt").write_text("second file")
    (root / "blocks.txt").write_text("block one\nline two\n\n\n  \nblock two\n\nblock three")
    write_jsonl(root / "sub" / "c.jsonl", ["json one", "json two"])
    with gzip.open(root / "d.jsonl.gz", "wt") as f:
        f.write('{"text": "gz one"}\n\n{"text": "gz two"}\n')
    (root / "notes.md").write_text("ignored inside a directory")
    data = str(tmp_path / "data")

    def docs(inputs, name, **kw):
        return _all_texts(prepare([str(i) for i in inputs], name, data, **FAST, **kw))

    txt = ["first file\n\nstill the first file\n", "second file"]
    assert docs([root / "a.txt", root / "sub/b.txt"], "txt") == sorted(txt)
    assert docs([root / "blocks.txt"], "blocks", txt_mode="blank_lines") == sorted(
        ["block one\nline two", "block two", "block three"]
    )
    assert docs([root / "sub/c.jsonl", root / "d.jsonl.gz"], "jsonl") == sorted(
        ["json one", "json two", "gz one", "gz two"]
    )
    everything = sorted(txt + ["block one\nline two\n\n\n  \nblock two\n\nblock three"])
    everything = sorted(everything + ["json one", "json two", "gz one", "gz two"])
    assert docs([root], "tree") == everything
    assert docs([f"{root}/**/*.jsonl", f"{root}/*.gz"], "glob") == sorted(
        ["json one", "json two", "gz one", "gz two"]
    )


def test_same_inputs_give_identical_files(tmp_path, paragraphs, write_jsonl):
    src = str(write_jsonl(tmp_path / "a.jsonl", paragraphs))
    a = prepare([src], "docs", str(tmp_path / "d1"), vocab_size=400, quiet=True)
    b = prepare([src], "docs", str(tmp_path / "d2"), vocab_size=400, quiet=True)
    names = sorted(f for f in os.listdir(a.dataset_dir) if f != "moetext_prepare.json")
    assert names == sorted(f for f in os.listdir(b.dataset_dir) if f != "moetext_prepare.json")
    assert any(".array_record-" in n for n in names) and "tokenizer.model" in names
    for n in names:
        with open(os.path.join(a.dataset_dir, n), "rb") as fa:
            with open(os.path.join(b.dataset_dir, n), "rb") as fb:
                assert fa.read() == fb.read(), n


def test_rerun_does_nothing_and_changes_need_overwrite(tmp_path, paragraphs, write_jsonl, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", paragraphs[:30])
    data = str(tmp_path / "data")
    first = prepare([str(src)], "docs", data, vocab_size=400)
    info = os.path.join(first.dataset_dir, "dataset_info.json")
    mtime = os.stat(info).st_mtime_ns
    capsys.readouterr()
    again = prepare([str(src)], "docs", data, vocab_size=400)
    assert not again.prepared and again.stats == first.stats
    assert again.tokenizer_path == first.tokenizer_path
    assert "nothing to do" in capsys.readouterr().out
    assert os.stat(info).st_mtime_ns == mtime

    with pytest.raises(ValueError, match=r"vocab_size=400 \(now 420\).*--overwrite"):
        prepare([str(src)], "docs", data, vocab_size=420)
    write_jsonl(src, paragraphs[:40])
    os.utime(src, ns=(mtime + 10**9, mtime + 10**9))
    with pytest.raises(ValueError, match=r"other inputs \(1 of 1 files new or changed\)"):
        prepare([str(src)], "docs", data, vocab_size=400)
    assert _all_texts(first) == sorted(paragraphs[:30])  # untouched by the refusals
    replaced = prepare([str(src)], "docs", data, vocab_size=400, overwrite=True)
    assert replaced.prepared and _all_texts(replaced) == sorted(paragraphs[:40])
    assert sorted(os.listdir(data)) == ["docs"]


def test_invalid_utf8_and_empty_documents_are_skipped_and_counted(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_bytes(
        b'{"text": "good one"}\n{"text": "bad \xff byte"}\n{"text": "   \\n"}\n'
        b'{"text": "lone \\ud800 surrogate"}\n{"text": "good two"}\n'
    )
    (tmp_path / "b.txt").write_bytes(b"\xc3\x28 invalid txt")
    result = prepare([str(src), str(tmp_path / "b.txt")], "docs", str(tmp_path / "d"), **FAST)
    assert result.stats.skipped_invalid_utf8 == 3 and result.stats.skipped_empty == 1
    assert _all_texts(result) == ["good one", "good two"]
    assert f"skipping 3 documents that are not valid UTF-8 (first: {src}:2)" in (
        capsys.readouterr().err
    )
    record = json.load(open(os.path.join(result.dataset_dir, "moetext_prepare.json")))
    assert record["stats"]["skipped_invalid_utf8"] == 3


def test_small_corpora_keep_both_splits_and_eval_fraction_zero_has_no_eval(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i}")
    result = prepare([str(tmp_path)], "few", str(tmp_path / "d"), eval_fraction=0.001, **FAST)
    assert result.stats.documents == {"train": 2, "eval": 1}
    result = prepare([str(tmp_path)], "none", str(tmp_path / "d"), eval_fraction=0.0, **FAST)
    assert result.stats.documents == {"train": 3, "eval": 0}
    assert list(tfds.builder_from_directory(result.dataset_dir).info.splits) == ["train"]


def _bad_inputs(tmp):
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "blank.txt").write_text("  \n\n")
    (tmp / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "no end\n')
    (tmp / "nokey.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    (tmp / "number.jsonl").write_text('{"text": 12}\n')
    (tmp / "list.jsonl").write_text('["text"]\n')
    (tmp / "data.csv").write_text("a,b\n")
    (tmp / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    return [
        ([tmp / "missing.jsonl"], FileNotFoundError, r"missing\.jsonl: no such file"),
        ([f"{tmp}/*.parquet"], FileNotFoundError, r"\*\.parquet' matches no file"),
        ([tmp / "empty.jsonl"], ValueError, r"no documents found in .*empty\.jsonl: 0 empty"),
        ([tmp / "blank.txt"], ValueError, r"no documents found in .*blank\.txt: 1 empty"),
        ([tmp / "bad.jsonl"], ValueError, r"bad\.jsonl:2: not valid JSON"),
        ([tmp / "nokey.jsonl"], ValueError, r"nokey\.jsonl:2: no 'text' field .*\['body'\]"),
        ([tmp / "number.jsonl"], ValueError, r"number\.jsonl:1: 'text' is a int, not a string"),
        ([tmp / "list.jsonl"], ValueError, r"list\.jsonl:1: no 'text' field .* list"),
        ([tmp / "data.csv"], ValueError, r"data\.csv: unsupported file type"),
        ([tmp / "bad.jsonl.gz"], ValueError, r"bad\.jsonl\.gz: cannot read"),
    ]


def test_bad_inputs_are_clear_errors_and_write_nothing(tmp_path):
    data = tmp_path / "data"
    for inputs, error, message in _bad_inputs(tmp_path):
        with pytest.raises(error, match=message):
            prepare([str(i) for i in inputs], "docs", str(data))
        assert not data.exists(), message
    for kwargs, message in [
        ({"vocab_size": 100}, r"--vocab_size 100 is too small.*at least 261"),
        ({"name": "my-corpus"}, r"--name 'my-corpus'"),
        ({"eval_fraction": 1.0}, r"--eval_fraction 1.0"),
    ]:
        with pytest.raises(ValueError, match=message):
            prepare([str(tmp_path / "number.jsonl")], **{"name": "docs", **kwargs}, data_dir=data)


def test_vocab_too_large_leaves_nothing_and_keeps_the_old_dataset(
    tmp_path, paragraphs, write_jsonl
):
    src = str(write_jsonl(tmp_path / "a.jsonl", paragraphs[:20]))
    data = tmp_path / "data"
    with pytest.raises(ValueError, match=r"vocab_size 60000 is too large.*at most \d+ pieces"):
        prepare([src], "docs", str(data), vocab_size=60_000, quiet=True)
    assert not data.exists()
    old = prepare([src], "docs", str(data), vocab_size=400, quiet=True)
    with pytest.raises(ValueError, match=r"vocab_size 60000 is too large"):
        prepare([src], "docs", str(data), vocab_size=60_000, overwrite=True, quiet=True)
    assert sorted(os.listdir(data)) == ["docs"] and os.listdir(data / "docs") == ["1.0.0"]
    assert prepare([src], "docs", str(data), vocab_size=400, quiet=True).stats == old.stats


def test_given_hf_tokenizer_is_copied_beside_the_dataset(tmp_path, paragraphs, write_jsonl):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        paragraphs[:10], trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"])
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text('{"bos_token": null, "eos_token": "<|endoftext|>"}')
    src = str(write_jsonl(tmp_path / "a.jsonl", paragraphs[:20]))
    result = prepare([src], "docs", str(tmp_path / "data"), tokenizer=str(hf), quiet=True)
    assert result.tokenizer_path == os.path.join(result.dataset_dir, "tokenizer.json")
    assert find_tokenizer(result.dataset_dir) == result.tokenizer_path
    assert os.path.exists(os.path.join(result.dataset_dir, "tokenizer_config.json"))
    assert load_tokenizer(result.dataset_dir).bos_id is None
    with pytest.raises(FileNotFoundError, match=r"tokenizer .*nope does not exist"):
        prepare([src], "other", str(tmp_path / "data"), tokenizer=str(tmp_path / "nope"))


def test_cli_prints_one_error_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    argv = ["--input", str(tmp_path / "bad.jsonl"), "--name", "x", "--data_dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prepare: error: {tmp_path / 'bad.jsonl'}:1: not valid JSON (")
    assert err.count("\n") == 1
    proc = subprocess.run(
        [sys.executable, "-m", "moetext.data.prepare", *argv[:-1], str(tmp_path / "d")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("prepare: error:")
    assert "Traceback" not in proc.stderr


def test_splits_larger_than_the_shuffle_buffer_spill_without_tensorflow(
    tmp_path, monkeypatch, paragraphs, write_jsonl
):
    # TFDS spills a split past its 1 GB buffer to bucket files via tf.io.gfile; a tiny buffer
    # takes that path here, which must work without TensorFlow and give the same files.
    from tensorflow_datasets.core import shuffle

    src = str(write_jsonl(tmp_path / "a.jsonl", paragraphs))
    in_memory = prepare([src], "docs", str(tmp_path / "mem"), **FAST)
    monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 1000)
    spilled = prepare([src], "docs", str(tmp_path / "spill"), **FAST)
    assert _all_texts(spilled) == sorted(paragraphs)
    for name in os.listdir(in_memory.dataset_dir):
        if ".array_record-" in name:
            with open(os.path.join(in_memory.dataset_dir, name), "rb") as a:
                with open(os.path.join(spilled.dataset_dir, name), "rb") as b:
                    assert a.read() == b.read(), name
    assert sorted(os.listdir(tmp_path / "spill")) == ["docs"]
