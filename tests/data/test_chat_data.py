"""Chat JSONL -> a prepared TFDS dataset of conversations -> packed rows with a loss mask."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetext.config import DataConfig
from moetext.data import chat_pipeline, chat_source
from moetext.data.batch import target_mask
from moetext.data.chat_template import CHATML
from moetext.data.pipeline import document_source
from moetext.data.prepare import main as prepare_main
from moetext.data.prepare import prepare
from moetext.data.tokenizer import load_tokenizer
from moetext.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        if i % 2:
            turns = [{"role": "user", "content": f"What is {a} plus {b}?"}]
            turns.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
            if i % 4 == 1:  # multi-turn
                turns += [
                    {"role": "user", "content": f"And {a} minus {b}?"},
                    {"role": "assistant", "content": f"{a} minus {b} is {a - b}."},
                ]
            out.append({"messages": [{"role": "system", "content": "You add."}, *turns]})
        else:
            out.append({"prompt": f"What is {a} plus {b}?", "completion": f"It is {a + b}."})
    return out


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    _write(root / "chats/a.jsonl", _conversations(120))
    _write(root / "chats/b.jsonl", _conversations(80, seed=1))
    # Relative paths from the data's parent, as a user types them (the CLI, verbatim).
    cmd = [
        sys.executable, "-m", "moetext.data.prepare", "--format", "chat",
        "--input", "chats/*.jsonl", "--name", "my_chats", "--data_dir", "data",
        "--vocab_size", "320", "--eval_fraction", "0.1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, text=True)
    return root


def test_prepare_keeps_conversations_and_chatml_tokens(prepared):
    d = prepared / "data/my_chats/1.0.0"
    tok = load_tokenizer(d)
    assert tok.token_id("<|im_start|>") is not None and tok.token_id("<|im_end|>") is not None
    train, evals = document_source(str(d), "train"), document_source(str(d), "eval")
    assert len(train) + len(evals) == 200 and len(evals) > 0
    records = [chat_source.read_messages(train[i]) for i in range(len(train))]
    by_source = {where: msgs for msgs, where in records}
    # Stored as structure, exactly as given (prompt/completion became two messages).
    first = _conversations(120)
    key = f"{prepared / 'chats/a.jsonl'}:2"
    if key in by_source:
        assert by_source[key] == first[1]["messages"]
    pc = [m for m, w in records if w.endswith(":1") and w.startswith(str(prepared / "chats/a"))]
    for msgs in pc:
        assert msgs == [
            {"role": "user", "content": first[0]["prompt"]},
            {"role": "assistant", "content": first[0]["completion"]},
        ]
    record = json.loads((d / "moetext_prepare.json").read_text())
    assert record["options"]["format"] == "chat"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"a\.jsonl:2: not valid JSON"),
        ('{"text": "hi"}', r"a\.jsonl:2: expected \{\"messages\""),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r":2: message 0 has role 'bot'"),
        ('{"messages": [{"role": "user"}]}', r":2: message 0 \(user\) has no content"),
        ('{"messages": [{"role": "user", "content": "x"}]}', r":2: .*no assistant message"),
        ('{"prompt": "q", "completion": 3}', r":2: 'completion' is a int"),
    ],
)
def test_bad_lines_name_file_and_line_and_write_nothing(tmp_path, line, message):
    good = json.dumps(_conversations(1)[0])
    (tmp_path / "a.jsonl").write_text(f"{good}\n{line}\n")
    with pytest.raises(ValueError, match=message):
        prepare([str(tmp_path / "a.jsonl")], "c", str(tmp_path / "data"), format="chat")
    assert not (tmp_path / "data").exists()


def test_txt_input_is_an_error_for_chat(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"--format chat reads \.jsonl"):
        prepare([str(tmp_path / "a.txt")], "c", str(tmp_path / "data"), format="chat")


def _cfg(prepared, **kw):
    base = dict(
        kind="chat", name="my_chats", data_dir=str(prepared / "data"), seq_len=64,
        global_batch_size=4, prefetch=1,
    )  # fmt: skip
    return DataConfig(**{**base, **kw})


def test_rows_hold_whole_conversations_with_the_assistant_mask(prepared):
    cfg = _cfg(prepared, seq_len=128)
    data = chat_pipeline.build(cfg, 512, range(4))
    tok, enc = data.tokenizer, data.encoder
    source = document_source(data.dataset_dir, "train")
    whole = {}  # every conversation as encoded alone: ids -> mask
    for i in range(len(source)):
        (ids, mask), status = enc(source[i])
        assert status == "fits"
        whole[tuple(ids)] = tuple(mask)
    seen = 0
    for _ in range(6):
        batch = data.next_batch()
        assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask"}
        for r in range(4):
            seg = batch["segment_ids"][r]
            for s in range(1, seg.max() + 1):
                at = seg == s
                ids = tuple(batch["tokens"][r][at])
                # A whole conversation, never split, positions from 0, its own mask.
                assert whole[ids] == tuple(batch["loss_mask"][r][at])
                assert (batch["positions"][r][at] == np.arange(at.sum())).all()
                seen += 1
            pad = seg == 0
            assert (batch["loss_mask"][r][pad] == 0).all()
            assert (batch["tokens"][r][pad] == tok.pad_id).all()
        # Only assistant answers count: every trained target decodes inside an answer.
        trained = batch["tokens"][:, 1:][target_mask(batch)]
        assert 0 < len(trained) < (batch["segment_ids"][:, 1:] != 0).sum() / 2
        assert tok.token_id("<|im_start|>") not in trained
        assert (trained == tok.token_id("<|im_end|>")).sum() >= seen // 6
    # The position is exact: a new reader restored to it gives the same next batches.
    state = data.get_state()
    after = [data.next_batch() for _ in range(2)]
    again = chat_pipeline.build(cfg, 512, range(4))
    again.restore([state])
    for a, b in zip(after, [again.next_batch() for _ in range(2)], strict=True):
        assert all((a[k] == b[k]).all() for k in a)
    data.close()
    again.close()


def test_overlong_conversations_are_cut_at_a_turn_or_dropped(prepared, capsys):
    # seq_len 64: single-turn conversations fit (30-60 tokens), two-turn ones (80-100) do not.
    truncating = chat_pipeline.build(_cfg(prepared, seq_len=64), 512, range(4))
    counts = truncating.counts
    assert counts["truncated"] > 0 and counts["fits"] > 0, counts
    assert "cut after their last assistant turn" in capsys.readouterr().err
    dropping = chat_pipeline.build(_cfg(prepared, seq_len=64, overlong="drop"), 512, range(4))
    assert dropping.counts["dropped"] == counts["truncated"] + counts["dropped"]
    for data in (truncating, dropping):
        batch = data.next_batch()
        for r in range(4):  # each conversation ends with a trained <|im_end|> (+ "\n")
            seg = batch["segment_ids"][r]
            for s in range(1, seg.max() + 1):
                at = np.flatnonzero(seg == s)
                last = at[batch["loss_mask"][r][at] == 1][-1]
                assert batch["tokens"][r][last] == data.tokenizer.token_id("<|im_end|>")
                assert at[-1] - last <= 1
        data.close()
    with pytest.raises(ConfigError, match="none of the .* conversations .* raise data.seq_len"):
        chat_pipeline.build(_cfg(prepared, seq_len=8), 512, range(4))


def test_train_on_all_and_template_errors_name_the_conversation(prepared, tmp_path):
    data = chat_pipeline.build(_cfg(prepared, train_on="all"), 512, range(4))
    batch = data.next_batch()
    assert (batch["loss_mask"] == (batch["segment_ids"] != 0)).all()
    data.close()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        "{% if messages | length > 3 %}{{ raise_exception('too long') }}{% endif %}" + CHATML
    )
    with pytest.raises(ConfigError, match=r"conversation .*chats/[ab]\.jsonl:\d+: .*too long"):
        chat_pipeline.build(_cfg(prepared, chat_template=str(bad)), 512, range(4))
    lines = [f"plain text document number {i}, with some words in it" for i in range(60)]
    (tmp_path / "texts.txt").write_text("\n\n".join(lines))
    texts = [str(tmp_path / "texts.txt")]
    prepare(texts, "texts", str(tmp_path), txt_mode="blank_lines", vocab_size=300, quiet=True)
    text = dataclasses.replace(_cfg(prepared), name="texts", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="holds text documents, not conversations"):
        chat_pipeline.build(text, 512, range(4))


def test_a_tokenizer_without_the_chat_pieces_is_refused_at_prepare_time(tmp_path, capsys):
    # A sentencepiece model trained on text (no user-defined symbols): <|im_start|> and
    # <|im_end|> are no pieces of it, and it has no chat template of its own.
    lines = [f"plain text document number {i}, with some words in it" for i in range(60)]
    (tmp_path / "texts.txt").write_text("\n\n".join(lines))
    prepare([str(tmp_path / "texts.txt")], "texts", str(tmp_path / "text_data"),
            txt_mode="blank_lines", vocab_size=300, quiet=True)  # fmt: skip
    spm = tmp_path / "text_data/texts/1.0.0/tokenizer.model"
    assert load_tokenizer(spm).token_id("<|im_start|>") is None
    chats = _write(tmp_path / "chats.jsonl", _conversations(8))
    argv = ["--format", "chat", "--input", str(chats), "--name", "c",
            "--data_dir", str(tmp_path / "data"), "--tokenizer", str(spm)]  # fmt: skip
    assert prepare_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"prepare: error: --tokenizer {spm} lacks "), err
    assert "<|im_start|>, <|im_end|>" in err and "chat_template.jinja" in err, err
    assert "leave out --tokenizer" in err, err
    assert not (tmp_path / "data").exists()  # refused before anything was written
    # The remedy it names: a template written for its pieces beside it, copied with it.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.model").write_bytes(spm.read_bytes())
    (mine / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    argv[-1] = str(mine / "tokenizer.model")
    assert prepare_main(argv) == 0
    assert (tmp_path / "data/c/1.0.0/chat_template.jinja").is_file()


def test_the_ahead_of_time_batch_is_the_one_chat_data_yields(prepared):
    # moetext.aot compiles the step for program.abstract_batch(..., batch_keys(data.kind)):
    # the same keys, shapes and dtypes as the rows the trainer feeds, or the compiled step
    # would not take them.
    import jax

    from moetext.data.batch import batch_keys
    from moetext.program import abstract_batch

    data = chat_pipeline.build(_cfg(prepared), 512, range(4))
    real = data.next_batch()
    data.close()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = abstract_batch(4, 64, one, batch_keys("chat"))
    assert {k: (v.shape, v.dtype) for k, v in abstract.items()} == {
        k: (v.shape, v.dtype) for k, v in real.items()
    }
