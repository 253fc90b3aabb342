"""Writes tests/fixtures/hf/chat_tokenizer/: a tiny byte-level BPE tokenizer with Qwen3's chat
template, and the ids transformers' `apply_chat_template` gives for a set of conversations
(run by hand, not by CI; `scripts/make_hf_fixture.py` calls it too).

Needs transformers (and torch, which it imports), never imported by moetext:

    python3.11 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install --no-deps 'torch==2.13.*'
    /tmp/hfvenv/bin/pip install filelock sympy networkx jinja2 fsspec typing-extensions \
        transformers==5.23.0 safetensors numpy
    /tmp/hfvenv/bin/python scripts/make_chat_fixture.py [--out tests/fixtures/hf]

Files: tokenizer.json (BPE trained with the `tokenizers` library on the conversations' text;
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>` as added tokens),
tokenizer_config.json (Qwen3-30B-A3B's chat_template, eos_token `<|im_end|>`, pad token
`<|endoftext|>`, as the released instruct model), and expected.json: per case the messages,
add_generation_prompt, transformers' rendered text and input_ids, and, for the ChatML template
with `{% generation %}` blocks (`generation_template` in the same file), transformers'
assistant_masks.
"""

# ruff: noqa: E501  (Qwen3's template is kept verbatim, long lines and all)
from __future__ import annotations

import argparse
import json
from pathlib import Path

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Qwen3-30B-A3B's tokenizer_config.json chat_template (the released instruct/thinking model).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# ChatML with {% generation %} blocks around what an assistant turn should learn.
GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
CASES = [
    [{"role": "user", "content": "What is 17 plus 25?"}, {"role": "assistant", "content": "42."}],
    [
        SYSTEM,
        {"role": "user", "content": "Name a prime number above 10."},
        {"role": "assistant", "content": "11 is prime: its only divisors are 1 and 11."},
        {"role": "user", "content": "And one above 20?"},
        {"role": "assistant", "content": "23."},
    ],
    [
        {"role": "user", "content": "Spell 'cat' backwards."},
        {"role": "assistant", "content": "<think>\nReverse c-a-t.\n</think>\n\ntac"},
        {"role": "user", "content": "Now 'dog'."},
        {"role": "assistant", "content": "<think>\nReverse d-o-g.\n</think>\n\ngod"},
    ],
    [
        SYSTEM,
        {"role": "user", "content": "Héllo — ünïcode? 你好"},
        {
            "role": "assistant",
            "content": "Yes: ünïcode works, 你好 too.",
            "reasoning_content": "Check.",
        },
    ],
    [SYSTEM, {"role": "user", "content": "What is 3 times 4?"}],
]


# Qwen2/Qwen3's pre-tokenizer split (their tokenizer.json's, and transformers' Qwen2Tokenizer's).
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A byte-level BPE built like Qwen3's tokenizer.json (NFC, the Qwen split, byte level)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=ADDED,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def make_chat_tokenizer(out: Path) -> None:
    d = out / "chat_tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    texts = [m["content"] for case in CASES for m in case] * 3
    train_tokenizer(texts).save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": QWEN3_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    cases = []
    for messages in CASES:
        prompt = messages[-1]["role"] != "assistant"
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        enc = tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=prompt, return_dict=True
        )
        gen = tok.apply_chat_template(
            messages,
            chat_template=GENERATION_TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=prompt,
        )
        cases.append(
            {
                "messages": messages,
                "add_generation_prompt": prompt,
                "text": text,
                "input_ids": list(enc["input_ids"]),
                "generation_input_ids": list(gen["input_ids"]),
                "generation_assistant_masks": list(gen["assistant_masks"]),
            }
        )
    expected = {
        "transformers": transformers.__version__,
        "generation_template": GENERATION_TEMPLATE,
        "cases": cases,
    }
    (d / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"{d}: {sorted(f.name for f in d.iterdir())}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/hf"))
    make_chat_tokenizer(Path(p.parse_args().out))


if __name__ == "__main__":
    main()
