"""Chat templates against transformers' apply_chat_template (ids stored in the fixture by
scripts/make_chat_fixture.py, so no torch here), and the assistant-only loss mask."""

import json
from pathlib import Path

import pytest

from moetext.data import chat_template as ct
from moetext.data.tokenizer import load_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/hf/chat_tokenizer"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))
CASES = EXPECTED["cases"]


@pytest.fixture(scope="module")
def qwen3():
    tok = load_tokenizer(FIXTURE)
    return tok, ct.load_chat_template(tok)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_qwen3_template_gives_transformers_text_and_ids(qwen3, i):
    tok, template = qwen3
    case = CASES[i]
    text = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert text == case["text"]
    assert tok.encode(text) == case["input_ids"]
    if not case["add_generation_prompt"]:  # the training path renders and tokenizes the same
        assert ct.encode(template, tok, case["messages"]).ids == case["input_ids"]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_generation_blocks_give_transformers_assistant_masks(qwen3, i):
    tok, _ = qwen3
    case = CASES[i]
    template = ct.ChatTemplate(EXPECTED["generation_template"], "fixture")
    assert template.has_generation_blocks
    if case["add_generation_prompt"]:
        text = template.render(case["messages"], add_generation_prompt=True)
        assert tok.encode(text) == case["generation_input_ids"]
        return
    enc = ct.encode(template, tok, case["messages"])
    assert enc.ids == case["generation_input_ids"]
    assert enc.mask == case["generation_assistant_masks"]


def _trained_text(tok, enc):
    """The trained tokens decoded, one string per maximal run."""
    runs, cur = [], []
    for i, m in zip(enc.ids, enc.mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_qwen3_assistant_mask_is_content_and_end_of_turn(qwen3):
    tok, template = qwen3
    # Two turns: the first is history (no think block), the last gets an empty one, which is
    # not trained; nor are role headers or the newline after <|im_end|>.
    enc = ct.encode(template, tok, CASES[1]["messages"])
    assert _trained_text(tok, enc) == [
        "11 is prime: its only divisors are 1 and 11.<|im_end|>",
        "23.<|im_end|>",
    ]
    assert enc.ids == CASES[1]["input_ids"]
    assert [enc.ids[t - 1] for t in enc.turn_ends] == [tok.token_id("<|im_end|>")] * 2
    # Content written with a think block: Qwen3 drops it from history turns and renders the
    # last one's; reasoning that is rendered is trained (as reasoning_content is), so the model
    # learns to think before it answers.
    enc = ct.encode(template, tok, CASES[2]["messages"])
    assert _trained_text(tok, enc) == [
        "tac<|im_end|>",
        "<think>\nReverse d-o-g.\n</think>\n\ngod<|im_end|>",
    ]
    enc = ct.encode(template, tok, CASES[3]["messages"])
    assert _trained_text(tok, enc) == [
        "<think>\nCheck.\n</think>\n\nYes: ünïcode works, 你好 too.<|im_end|>"
    ]
    enc = ct.encode(template, tok, CASES[1]["messages"], train_on="all")
    assert enc.mask == [1] * len(enc.ids)


def test_chatml_builtin_and_errors(tmp_path, qwen3):
    tok, _ = qwen3
    # A tokenizer with the ChatML tokens but no template of its own gets the built-in one.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((FIXTURE / "tokenizer.json").read_bytes())
    t = ct.load_chat_template(load_tokenizer(bare))
    assert t.source == ct.CHATML
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert t.render(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    # data.chat_template overrides; a template that raises names itself.
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('only user turns, please') }}")
    t = ct.load_chat_template(tok, str(raising))
    with pytest.raises(ct.ChatTemplateError, match=r"raising\.jinja raised: only user turns"):
        t.render(msgs)
    with pytest.raises(ct.ChatTemplateError, match="data.chat_template='/nope.jinja'"):
        ct.load_chat_template(tok, "/nope.jinja")
    # A template that rewrites the answer cannot be masked by offsets: told so.
    upper = tmp_path / "upper.jinja"
    upper.write_text("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(ct.ChatTemplateError, match=r"\{% generation %\} blocks"):
        ct.encode(ct.load_chat_template(tok, str(upper)), tok, msgs)


def test_sentencepiece_without_chatml_tokens_names_data_chat_template(tmp_path):
    from moetext.data.train_tokenizer import train_sentencepiece

    lines = [f"line {i} of some text to learn pieces from" for i in range(200)]
    model = train_sentencepiece(lines, str(tmp_path / "tokenizer.model"), vocab_size=300)
    with pytest.raises(ct.ChatTemplateError, match="set data.chat_template"):
        ct.load_chat_template(load_tokenizer(model))


def test_template_environment_matches_transformers():
    t = ct.ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}|{{ strftime_now('%Y') | length }}",
        "env",
    )
    # tojson does not escape HTML (jinja's own would write \u003c), loopcontrols work.
    assert t.render([{"role": "user", "content": "<a>é"}, {}]) == (
        '{"role": "user", "content": "<a>é"}|4'
    )
    sandboxed = ct.ChatTemplate("{{ messages.append(1) }}", "sandbox")
    with pytest.raises(ct.ChatTemplateError, match="raised"):
        sandboxed.render([])
