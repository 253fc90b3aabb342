"""Conversations from chat JSONL files, one per line, checked and kept as structure.

Two line forms (TRL's "conversational" and "prompt-completion" datasets):

- `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}`
  (OpenAI / Hugging Face). Other keys of a message (reasoning_content, tool_calls, name) are
  kept: templates read them.
- `{"prompt": ..., "completion": ...}`: each a string (a user message / an assistant
  message) or a list of messages.

A conversation is stored as the JSON text of its message list (moetext.data.prepare writes it
as the `messages` feature), so the chat template is applied when training, not here.
Errors name the file and line: not JSON, neither form, a message that is not an object, an
unknown role, a missing or non-string content, no assistant turn. Bytes that are not valid
UTF-8 give a Document with text=None (skipped and counted, as for text).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from moetext.data.sources import Document, SourceFile, jsonl_documents

ROLES = ("system", "user", "assistant", "tool")
EXTENSIONS = (".jsonl", ".jsonl.gz")


def check_files(files: Sequence[SourceFile]) -> None:
    bad = [f.path for f in files if not f.path.endswith(EXTENSIONS)]
    if bad:
        raise ValueError(
            f"{bad[0]}: --format chat reads {' and '.join(EXTENSIONS)} files (one conversation "
            f"a line), not {bad[0].rsplit('.', 1)[-1]}"
        )


def iter_conversations(
    files: Sequence[SourceFile], *, want: Callable[[str], bool] | None = None
) -> Iterator[Document]:
    """Every conversation (text = the JSON of its messages) in order; `want` as in
    sources.iter_documents."""
    for f in files:
        try:
            yield from _file(f, want)
        except (OSError, EOFError) as e:
            raise ValueError(f"{f.path}: cannot read: {e}") from None


def _file(f: SourceFile, want: Callable[[str], bool] | None) -> Iterator[Document]:
    def text_of(record: Any, where: str) -> str:
        return json.dumps(messages_of(record, where), ensure_ascii=False)

    return jsonl_documents(f, want, text_of)


def messages_of(record: Any, where: str) -> list[dict[str, Any]]:
    """The record's conversation as a checked list of messages."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError(f"{where}: 'messages' is a {type(messages).__name__}, not a list")
    elif isinstance(record, dict) and "prompt" in record and "completion" in record:
        messages = _part(record["prompt"], "user", "prompt", where) + _part(
            record["completion"], "assistant", "completion", where
        )
    else:
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f'{where}: expected {{"messages": [...]}} or {{"prompt": ..., "completion": '
            f"...}}; the line has {got}"
        )
    for i, m in enumerate(messages):
        _check_message(m, i, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant message (nothing to learn)")
    return [dict(m) for m in messages]


def _part(value: Any, role: str, field: str, where: str) -> list[Any]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise ValueError(
        f"{where}: {field!r} is a {type(value).__name__}; expected a string or a list of messages"
    )


def _check_message(m: Any, i: int, where: str) -> None:
    if not isinstance(m, dict):
        raise ValueError(f"{where}: message {i} is a {type(m).__name__}, not an object")
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: message {i} has role {role!r}; expected one of {list(ROLES)}")
    content = m.get("content")
    if content is None and role == "assistant" and m.get("tool_calls"):
        m["content"] = ""  # a pure tool call: templates expect a string
    elif not isinstance(content, str):
        what = "no content" if content is None else f"content of type {type(content).__name__}"
        raise ValueError(f"{where}: message {i} ({role}) has {what}; expected a string")


def read_messages(record: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """(messages, source "file:line") of a prepared chat record (bytes or str features)."""
    text, source = record["messages"], record.get("source", b"?")
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    source = source.decode("utf-8") if isinstance(source, bytes) else str(source)
    messages: list[dict[str, Any]] = json.loads(text)
    return messages, source


__all__ = ["ROLES", "check_files", "iter_conversations", "messages_of", "read_messages"]
