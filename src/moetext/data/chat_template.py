"""Chat templates: a conversation -> the text a model is trained on (or prompted with), and
which characters of it the loss is on.

Templates are jinja2, rendered in the environment transformers' `apply_chat_template` uses
(an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, the loopcontrols
extension, a `tojson` that does not escape HTML, `strftime_now`, `raise_exception`, and the
`{% generation %}` block), with the variables `messages`, `add_generation_prompt`, `tools`
(None), `bos_token`, `eos_token`, `pad_token` and `unk_token`, plus any the caller adds
(`render(..., variables={"enable_thinking": False})`, as apply_chat_template's extra keyword
arguments: Qwen3's template then writes an empty think block into the generation prompt); the
rendered text is tokenized as a whole, without added special tokens, so the ids are those
transformers gives.

Where the template comes from (`load_chat_template`): `data.chat_template` (a file) when set;
else `chat_template.jinja` beside the tokenizer file; else `chat_template` in
`tokenizer_config.json` beside it; else the built-in ChatML template (`CHATML`), which needs
`<|im_start|>` and `<|im_end|>` to be single tokens of the tokenizer (a sentencepiece model
that `prepare --format chat` trains has them).

What the loss is on (`ChatTemplate.trained_spans`): the `{% generation %}` blocks when the
template has them (as transformers' return_assistant_tokens_mask); else each assistant
message's content, found by character offsets in the rendered text, plus the end-of-turn
token right after it, and a non-empty `<think>` block rendered right before it (not the role
header, not an empty think block, not the newline after the end of turn). Offsets, not
re-rendering prefixes: Qwen3's template is not prefix-stable (only the last assistant turn
gets `<think>\\n\\n</think>\\n\\n`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moetext.data.tokenizer import CHAT_TEMPLATE_FILE, HF_CONFIG_FILE, Tokenizer

Message = Mapping[str, Any]  # {"role": ..., "content": ..., and whatever else the template reads}
# The variables `ChatTemplate` sets itself (besides the special tokens): extra ones may not.
RENDERER_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents")

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
# Tokens that end a turn in well-known templates (ChatML/Qwen, Llama 3, Gemma, Phi-3, Llama 2),
# besides the tokenizer's own EOS: the one right after an assistant message carries loss.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")


class ChatTemplateError(ValueError):
    """A template that cannot be loaded, raises while rendering, or hides an assistant turn."""


@dataclass(frozen=True)
class Encoded:
    """A conversation as ids, its loss mask, and where each assistant turn ends (in tokens)."""

    ids: list[int]
    mask: list[int]  # 1: the token is a trained target
    turn_ends: list[int]  # token count up to and including each assistant turn's last token


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the block's character span."""

        tags = {"generation"}

        def __init__(self, environment: Any):
            super().__init__(environment)
            self.blocks: list[str] | None = None
            self.spans: list[tuple[int, int]] = []

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation", [])
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            text: str = caller()
            if self.blocks is not None:  # the blocks rendered so far precede this one
                start = sum(len(b) for b in self.blocks)
                self.spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
        sort_keys: bool = False,
    ) -> str:  # fmt: skip
        # jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTracker, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with."""

    def __init__(self, source: str, origin: str, special_tokens: Mapping[str, str] | None = None):
        import jinja2

        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        self._env = _environment()
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template {origin}: line {e.lineno}: {e}") from None
        self._tracker = next(e for e in self._env.extensions.values() if hasattr(e, "spans"))
        self.has_generation_blocks = bool(_GENERATION_TAG.search(source))

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation's text; `variables` are more template variables (e.g. Qwen3's
        enable_thinking), never one of those the renderer sets itself."""
        return self._render(messages, add_generation_prompt, variables)[0]

    def _render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        variables: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        variables = dict(variables or {})
        reserved = sorted(set(variables) & {*RENDERER_VARIABLES, *self.special_tokens})
        if reserved:
            raise ChatTemplateError(
                f"chat template variables {reserved} are set by the renderer itself; extra "
                f"variables may not replace them"
            )
        blocks: list[str] = []
        with _tracking(self._tracker, blocks):
            try:
                for block in self._template.generate(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    tools=None,
                    documents=None,
                    **self.special_tokens,
                    **variables,
                ):
                    blocks.append(block)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template {self.origin} raised: {e}") from None
            spans = list(self._tracker.spans)
        return "".join(blocks), spans

    def trained_spans(
        self, messages: Sequence[Message], *, required: bool = True
    ) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, [start, end) character spans the loss is on), in order; an assistant
        message that cannot be found is an error when `required`, else left out."""
        text, generation = self._render(messages, add_generation_prompt=False)
        if self.has_generation_blocks:
            return text, generation
        spans, cursor = [], 0
        eot = [self.special_tokens.get("eos_token", ""), *END_OF_TURN]
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            start, end = _locate(text, str(m.get("content") or ""), cursor)
            if start < 0 and not required:
                continue
            if start < 0:
                raise ChatTemplateError(
                    f"chat template {self.origin} does not render message {i} (assistant) "
                    f"verbatim, so its tokens cannot be found for the loss mask: use a template "
                    f"with {{% generation %}} blocks (data.chat_template) or data.train_on=all"
                )
            end += next((len(t) for t in eot if t and text.startswith(t, end)), 0)
            spans.append((_with_reasoning(text, cursor, start), end))
            cursor = end
        return text, spans


def _locate(text: str, content: str, cursor: int) -> tuple[int, int]:
    """Where an assistant message's content is rendered at or after `cursor`: as given, or as
    templates rewrite it (Qwen3 moves a leading <think>...</think> out and strips newlines)."""
    candidates = [content, content.split("</think>")[-1].lstrip("\n"), content.strip()]
    for c in candidates:
        if not c:
            continue
        at = text.find(c, cursor)
        if at >= 0:
            return at, at + len(c)
    if not content.strip():  # an empty answer: only its end-of-turn token, found after cursor
        hits = [(text.find(t, cursor), t) for t in END_OF_TURN if t in text[cursor:]]
        if hits:
            at = min(hits)[0]
            return at, at
    return -1, -1


def _with_reasoning(text: str, cursor: int, start: int) -> int:
    """Moves a content span's start back over a non-empty `<think>...</think>` block rendered
    right before it (the reasoning is part of what the model learns; an empty block is not)."""
    before, close = text[cursor:start], "</think>\n\n"
    opened = before.rfind("<think>")
    if opened >= 0 and before.endswith(close) and before[opened + 7 : -len(close)].strip():
        return cursor + opened
    return start


@contextlib.contextmanager
def _tracking(tracker: Any, blocks: list[str]) -> Iterator[None]:
    tracker.blocks, tracker.spans = blocks, []
    try:
        yield
    finally:
        tracker.blocks = None


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*[-+]?%\}")


def encode(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    *,
    train_on: str = "assistant",
) -> Encoded:
    """The conversation rendered (no generation prompt) and tokenized as a whole, with its loss
    mask: assistant spans only (train_on=assistant) or every token (train_on=all)."""
    # train_on=all needs the assistant turns only to truncate at their ends.
    text, spans = template.trained_spans(messages, required=train_on != "all")
    ids, offsets = tokenizer.encode_with_offsets(text)
    # A zero-width token (sentencepiece's leading byte-fallback pieces of a character, its
    # dummy-prefix "▁") is part of the next token's characters: give it that span.
    for i in range(len(offsets) - 2, -1, -1):
        if offsets[i][0] == offsets[i][1]:
            offsets[i] = offsets[i + 1]
    mask = [0] * len(ids)
    turn_ends: list[int] = []
    t = 0
    for start, end in spans:  # a token is trained when its characters overlap a span
        while t < len(ids) and offsets[t][1] <= start:
            t += 1
        while t < len(ids) and offsets[t][0] < end:
            mask[t] = 1
            t += 1
        turn_ends.append(t)
    if train_on == "all":
        mask = [1] * len(ids)
    return Encoded(ids, mask, turn_ends)


def load_chat_template(tokenizer: Tokenizer, override: str | None = None) -> ChatTemplate:
    """The template for `tokenizer` (see the module docstring); raises ChatTemplateError naming
    data.chat_template when none fits."""
    config = _tokenizer_config(tokenizer.path)
    special = {
        k: v
        for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (v := _content(config.get(k))) is not None
    }
    if override:
        path = os.path.expanduser(override)
        try:
            with open(path, encoding="utf-8") as f:
                return ChatTemplate(f.read(), path, special)
        except OSError as e:
            raise ChatTemplateError(f"data.chat_template={override!r}: cannot read: {e}") from None
    here = os.path.dirname(os.path.abspath(tokenizer.path))
    jinja_file = os.path.join(here, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return ChatTemplate(f.read(), jinja_file, special)
    source = _config_template(config)
    if source is not None:
        return ChatTemplate(source, os.path.join(here, HF_CONFIG_FILE), special)
    missing = [t for t in CHATML_TOKENS if tokenizer.token_id(t) is None]
    if missing:
        raise ChatTemplateError(
            f"the tokenizer {tokenizer.path} has no chat template (no {CHAT_TEMPLATE_FILE}, no "
            f"chat_template in {HF_CONFIG_FILE}) and the built-in ChatML template needs "
            f"{', '.join(missing)} as single tokens, which it lacks: set data.chat_template to "
            f"a jinja template file written for this tokenizer"
        )
    return ChatTemplate(CHATML, "ChatML (built in)", special)


def _tokenizer_config(tokenizer_path: str) -> dict[str, Any]:
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), HF_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"cannot read {path}: {e}") from None
    return config if isinstance(config, dict) else {}


def _config_template(config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or [{name, template}] (the default)."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _content(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def end_of_turn_ids(template: ChatTemplate, tokenizer: Tokenizer) -> list[int]:
    """Ids that end an assistant reply: the tokenizer's EOS and the template's end-of-turn
    tokens that are single tokens of this tokenizer (generate --chat stops at any of them)."""
    ids = {tokenizer.eos_id}
    for t in (template.special_tokens.get("eos_token", ""), *END_OF_TURN):
        if t and t in template.source and (i := tokenizer.token_id(t)) is not None:
            ids.add(i)
    return sorted(ids)
