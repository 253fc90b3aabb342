"""Tokenizers: sentencepiece trained by moetext round-trips any text; Hugging Face tokenizer.json
files load with their BOS/EOS/pad from tokenizer_config.json."""

import json
import re

import pytest

from moetext.data.tokenizer import (
    HfTokenizer,
    SentencePieceTokenizer,
    find_tokenizer,
    load_tokenizer,
)
from moetext.data.train_tokenizer import sample_lines, train_sentencepiece

CODE = (
    "def f(x):\n\tif x  >  1:\n\t\treturn 'é日本'   # ok\n\n\n    pass\r\n"
    "  leading and trailing  \n\x0bvertical tab\u00a0nbsp\u3000ideographic space "
)
UNSEEN = "\U0001d518\u26a1"  # characters that are not in the training text


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, paragraphs):
    path = tmp_path_factory.mktemp("sp") / "tok.model"
    lines = sample_lines([{"text": p.encode()} for p in paragraphs], 10**9, None)
    return str(train_sentencepiece(lines, str(path), vocab_size=400))


def test_sentencepiece_round_trips_code_and_unicode(sp_model):
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (400, 0, 2, 3)
    for text in [CODE, UNSEEN, "", " ", "\n", "x" * 10_000, "  two  spaces  "]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert 1 not in ids  # never <unk>: byte fallback covers everything
    assert tok.encode("a")[0] not in (tok.bos_id, tok.eos_id)  # no specials added


def test_unseen_characters_fall_back_to_bytes(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    pieces = [sp.id_to_piece(i) for i in load_tokenizer(sp_model).encode(UNSEEN)]
    utf8 = UNSEEN.encode()
    assert pieces[-len(utf8) :] == [f"<0x{b:02X}>" for b in utf8]


def test_sentencepiece_saves_into_a_directory_that_loads(sp_model, tmp_path):
    saved = load_tokenizer(sp_model).save(str(tmp_path / "run"))
    assert saved == str(tmp_path / "run" / "tokenizer.model")
    assert find_tokenizer(tmp_path / "run") == saved
    assert load_tokenizer(tmp_path / "run").encode(CODE) == load_tokenizer(sp_model).encode(CODE)
    assert find_tokenizer(tmp_path) is None


def _hf_tokenizer(directory, config=None, eos="<|endoftext|>", bos_template=None):
    """A tiny byte-level BPE tokenizer.json (+ tokenizer_config.json when config is given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [eos] + (["<s>"] if bos_template else [])
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog", CODE], trainer)
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


QWEN_LIKE = {"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False}


def test_hf_tokenizer_loads_from_file_and_directory(tmp_path):
    d = _hf_tokenizer(tmp_path / "hf", QWEN_LIKE)
    for path in (d, d / "tokenizer.json"):
        tok = load_tokenizer(path)
        assert isinstance(tok, HfTokenizer)
        assert tok.bos_id is None
        assert tok.eos_id == tok.pad_id == tok._tok.token_to_id("<|endoftext|>")
        assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)
        assert tok.decode(tok.encode(CODE)) == CODE
        assert tok.eos_id not in tok.encode(CODE)
    saved = load_tokenizer(d).save(str(tmp_path / "copy"))
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert find_tokenizer(tmp_path / "copy") == saved


def test_hf_special_tokens_from_config_dicts_and_post_processor(tmp_path):
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": {"content": "<|endoftext|>"},
        "pad_token": "<s>",
        "add_bos_token": True,
    }
    tok = load_tokenizer(_hf_tokenizer(tmp_path / "a", config, bos_template=True))
    assert tok.bos_id == tok.pad_id == tok._tok.token_to_id("<s>")
    # No config: EOS from the well-known names, BOS what the post-processor prepends.
    tok = load_tokenizer(_hf_tokenizer(tmp_path / "b", None, eos="</s>", bos_template=True))
    assert (tok.eos_id, tok.bos_id) == (tok._tok.token_to_id("</s>"), tok._tok.token_to_id("<s>"))
    assert tok.pad_id == tok.eos_id
    tok = load_tokenizer(_hf_tokenizer(tmp_path / "c", {"eos_token": "<|endoftext|>"}))
    assert tok.bos_id is None


def test_hf_tokenizer_errors_name_the_problem(tmp_path):
    d = _hf_tokenizer(tmp_path / "noeos", None, eos="<|stop|>")
    with pytest.raises(ValueError, match=r"cannot determine the EOS token of .*noeos"):
        load_tokenizer(d)
    d = _hf_tokenizer(tmp_path / "badeos", {"eos_token": "<|nope|>"})
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in the vocabulary"):
        load_tokenizer(d)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.model does not exist.*expected"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty holds neither tokenizer.json nor"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"vocab\.txt: unknown kind of file"):
        load_tokenizer(tmp_path / "vocab.txt")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"bad\.model is not a sentencepiece model"):
        load_tokenizer(tmp_path / "bad.model")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"bad\.json is not a Hugging Face tokenizer"):
        load_tokenizer(tmp_path / "bad.json")


def test_vocab_size_limits_are_errors_naming_the_limit(paragraphs, tmp_path):
    def train(vocab_size):
        lines = sample_lines([{"text": p.encode()} for p in paragraphs[:20]], 10**9, None)
        train_sentencepiece(lines, str(tmp_path / "t.model"), vocab_size=vocab_size)

    with pytest.raises(ValueError, match=r"vocab_size 50000 is too large .* at most (\d+) pieces"):
        train(50_000)
    with pytest.raises(ValueError, match=r"vocab_size 262 is too small .* need (\d+)"):
        train(262)
    assert not list(tmp_path.iterdir())


def test_sample_lines_is_bounded_spread_and_deterministic():
    docs = [{"text": f"doc {i}\n\n  \nline two of {i}".encode()} for i in range(100)]
    lines = list(sample_lines(docs, max_chars=200, total_chars=100 * 25))
    assert sum(map(len, lines)) == 200
    assert lines == list(sample_lines(docs, max_chars=200, total_chars=100 * 25))
    firsts = [int(x[4:]) for x in lines if re.fullmatch(r"doc \d+", x)]
    assert firsts[:3] == [0, 12, 24]  # evenly spaced, not the first documents
    assert all(x.strip() for x in lines)
    long = list(sample_lines([{"text": b"y" * 10_000}], 10**9, None))
    assert [len(x) for x in long] == [4096, 4096, 1808]  # cut under max_sentence_length


def test_hf_tokenizer_trains_through_the_data_pipeline(tmp_path):
    # data.tokenizer=<a Qwen-like tokenizer.json> over the embedded corpus: no BOS, EOS ends
    # each document, the run copies the tokenizer in; a packed batch decodes back to text.
    from moetext import config, train

    d = _hf_tokenizer(tmp_path / "hf", QWEN_LIKE)
    tok = load_tokenizer(d)
    tiny = "configs/models/tiny-qwen3-moe.yml"
    cfg = config.load(
        tiny,
        [
            f"data.tokenizer={d}",
            f"train.run_dir={tmp_path / 'run'}",
            "train.steps=2",
            "train.log_every=1",
            "train.eval_every=2",
            "train.progress_bar=false",
            "train.peak_tflops=1.0",
            "checkpoint.enabled=false",
            f"model.vocab_size={tok.vocab_size}",
        ],
    )
    from moetext import data as data_lib

    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    try:
        batch = data.next_batch()
    finally:
        data.close()
    tokens, seg = batch["tokens"], batch["segment_ids"]
    ends = tokens[:, :-1][seg[:, 1:] != seg[:, :-1]]
    assert len(ends) >= 1 and (ends == tok.eos_id).all()  # every document ends with EOS
    assert tok.bos_id is None and sum(len(tok.decode(r)) for r in tokens) > tokens.size
    last = train.run(cfg)
    assert last["step"] == 2 and "eval_perplexity" in last
    assert (tmp_path / "run/tokenizer/tokenizer.json").exists()
