"""generate --chat's pieces without a model: the prompt it renders, where it stops, its
argument rules and errors."""

import json
import re
from pathlib import Path

import pytest

from moetext.data.chat_template import CHATML, ChatTemplateError
from moetext.data.tokenizer import load_tokenizer
from moetext.errors import ConfigError
from moetext.generate import chat
from moetext.generate.__main__ import main, template_vars

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/hf/chat_tokenizer"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))


def test_prompt_is_transformers_generation_prompt_and_stops_cover_end_of_turn(tmp_path):
    tok = load_tokenizer(FIXTURE)
    template = chat.template_for(tok, None)
    case = EXPECTED["cases"][-1]  # system + user, add_generation_prompt (transformers' ids)
    system, user = case["messages"][0]["content"], case["messages"][1]["content"]
    conv = chat.conversation(user, system)
    assert conv == case["messages"]
    assert tok.encode(template.render(conv, add_generation_prompt=True)) == case["input_ids"]
    im_end, eot = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
    assert chat.stop_ids(template, tok) == tuple(sorted({im_end, tok.eos_id}))
    # generation_config.json's eos_token_id (an id or a list) is a stop too.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    assert chat.stop_ids(template, tok, str(tmp_path)) == tuple(sorted({im_end, eot}))


def test_missing_template_names_data_chat_template(tmp_path):
    from moetext.data.train_tokenizer import train_sentencepiece

    lines = [f"line {i} of text to learn pieces from" for i in range(200)]
    model = train_sentencepiece(lines, str(tmp_path / "tokenizer.model"), vocab_size=300)
    with pytest.raises(ConfigError, match="--chat: .*set data.chat_template"):
        chat.template_for(load_tokenizer(model), None)
    (tmp_path / "t.jinja").write_text(CHATML)
    assert chat.template_for(load_tokenizer(model), str(tmp_path / "t.jinja")).source == CHATML


@pytest.mark.parametrize("extra", [["--prompt", "a", "--chat", "b"], []], ids=["both", "neither"])
def test_prompt_and_chat_are_exclusive_and_one_is_required(extra, capsys):
    with pytest.raises(SystemExit) as e:
        main(["config.yml", "--checkpoint", "ckpt", *extra])
    assert e.value.code == 2
    assert "--prompt" in capsys.readouterr().err


def test_template_variables_reach_the_template_and_the_cli_reads_them():
    # Qwen3's template (the fixture's): enable_thinking=false writes an empty think block
    # after the generation prompt's assistant header, and nothing else changes.
    tok = load_tokenizer(FIXTURE)
    template = chat.template_for(tok, None)
    conv = chat.conversation("What is 2+2?")

    def prompt(**variables):
        return template.render(conv, add_generation_prompt=True, variables=variables)

    plain = prompt()
    assert plain.endswith("<|im_start|>assistant\n")
    assert prompt(enable_thinking=False) == plain + "<think>\n\n</think>\n\n"
    assert prompt(enable_thinking=True) == plain
    with pytest.raises(ChatTemplateError, match=r"\['messages'\] are set by the renderer"):
        prompt(messages=[])
    assert template_vars(["enable_thinking=false", "n=3", "who=a b"]) == {
        "enable_thinking": False,
        "n": 3,
        "who": "a b",
    }
    for bad, message in (
        ("enable_thinking", "expected NAME=VALUE"),
        ("1x=2", "expected NAME=VALUE"),
        ("x=[1", "VALUE is not YAML"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"--template-var {bad!r}: {message}")):
            template_vars([bad])
