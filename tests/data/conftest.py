"""Small real text for the data tests: paragraphs of CPython's documentation topics."""

import json

import pytest


@pytest.fixture(scope="session")
def paragraphs() -> list[str]:
    """~150 paragraphs (~100k characters) of English and code, deterministic."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics)[:40]:
        out += [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 40]
    return out[:150]


@pytest.fixture
def write_jsonl():
    """write_jsonl(path, texts, key="text") -> path: one {key: text} object per line."""

    def write(path, texts, key="text"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")
        return path

    return write
