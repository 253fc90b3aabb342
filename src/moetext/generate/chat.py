"""Chat with a checkpoint: conversations -> the template's generation prompt -> the reply.

Each conversation is rendered with the tokenizer's chat template (moetext.data.chat_template:
tokenizer_config.json / chat_template.jinja, data.chat_template, else built-in ChatML) and
`add_generation_prompt`, tokenized as a whole (the template writes any BOS itself, as
transformers does), and continued until an end-of-turn token or EOS: the tokenizer's EOS, the
template's end-of-turn tokens that are single tokens (e.g. `<|im_end|>`), and
`generation_config.json`'s `eos_token_id` (an id or a list) beside the checkpoint or the
tokenizer. The reply is the text of the new tokens before that stop token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from moetext.data.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    end_of_turn_ids,
    load_chat_template,
)
from moetext.data.tokenizer import Tokenizer
from moetext.errors import ConfigError
from moetext.generate.decode import Generated, generate_ids
from moetext.generate.sampling import Sampling

GENERATION_CONFIG = "generation_config.json"
Conversation = list[dict[str, Any]]


def template_for(tokenizer: Tokenizer, override: str | None) -> ChatTemplate:
    """The chat template, or a ConfigError naming data.chat_template."""
    try:
        return load_chat_template(tokenizer, override)
    except ChatTemplateError as e:
        raise ConfigError(f"--chat: {e}") from None


def stop_ids(template: ChatTemplate, tokenizer: Tokenizer, *dirs: str) -> tuple[int, ...]:
    """EOS, the template's end-of-turn tokens and generation_config.json's eos_token_id (the
    first such file in `dirs`)."""
    ids = set(end_of_turn_ids(template, tokenizer))
    for d in dirs:
        path = os.path.join(d, GENERATION_CONFIG)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        ids.update([eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)])
        break
    return tuple(sorted(ids))


def conversation(user: str, system: str | None = None) -> Conversation:
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": user}]


def reply(
    model: Any,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    conversations: Sequence[Conversation],
    *,
    stop: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    seed: int = 0,
    max_len: int | None = None,
    batch_multiple: int = 1,
    variables: Mapping[str, Any] | None = None,
) -> tuple[list[str], Generated]:
    """The assistant's next reply to each conversation (batched), and the raw result;
    `variables` are extra chat-template variables (--template-var, e.g. enable_thinking)."""
    try:
        prompts = [
            template.render(c, add_generation_prompt=True, variables=variables)
            for c in conversations
        ]
    except ChatTemplateError as e:
        raise ConfigError(f"--chat: {e}") from None
    out = generate_ids(
        model,
        [tokenizer.encode(p) for p in prompts],
        max_new_tokens=max_new_tokens,
        eos_id=stop,
        pad_id=tokenizer.pad_id,
        sampling=sampling,
        seed=seed,
        max_len=max_len,
        batch_multiple=batch_multiple,
    )
    return [tokenizer.decode(t) for t in out.tokens], out


__all__ = ["conversation", "reply", "stop_ids", "template_for"]
