"""One small tokenizer interface over sentencepiece models and Hugging Face tokenizer.json files.

`load_tokenizer(path)` picks the kind from the path: a `.model` file (or a directory holding
`tokenizer.model`) is sentencepiece; a `tokenizer.json` (or a directory holding one) is a
Hugging Face tokenizer, read with the `tokenizers` library (no transformers, no torch).
`encode` never adds special tokens: the input pipeline adds BOS (when the tokenizer has one
to prepend) and EOS around every document itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any, Protocol

from etils import epath

SENTENCEPIECE_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
# transformers >= 4.43 saves the chat template in its own file beside the tokenizer.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# End-of-text tokens of well-known byte-level BPE families (GPT-2/Qwen, Llama 2, Gemma, Llama 3),
# tried in this order when no tokenizer_config.json names the EOS.
HF_EOS_FALLBACKS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_EXPECTED = "a sentencepiece .model file, a Hugging Face tokenizer.json, or a directory holding one"


class Tokenizer(Protocol):
    """Text <-> ids. `bos_id` is None when the tokenizer defines no BOS to prepend."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    path: str  # the file it was loaded from
    files: list[str]  # every file needed to load it again (copied by `save`)

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode(text) and each id's [start, end) character span in text."""
        ...

    def token_id(self, token: str) -> int | None:
        """The id of `token` when it is one piece of the vocabulary, else None."""
        ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, directory: str) -> str: ...


class SentencePieceTokenizer:
    """A sentencepiece `.model` file."""

    def __init__(self, path: str):
        import sentencepiece as spm

        self.path, self.files = str(path), [str(path), *_chat_template_files(str(path))]
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"tokenizer {self.path} is not a sentencepiece model: {e}") from None
        self.vocab_size = int(self._sp.vocab_size())
        # sentencepiece reports an id it does not define as -1.
        bos, eos, pad = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        if eos < 0:
            raise ValueError(f"sentencepiece model {self.path} defines no EOS id (eos_id=-1)")
        self.bos_id = bos if bos >= 0 else None
        self.eos_id = eos
        self.pad_id = pad if pad >= 0 else eos

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        mapped = self._sp.encode_as_offset_mapping(text)  # character offsets
        return [int(i) for i in mapped["ids"]], [(int(a), int(b)) for a, b in mapped["offsets"]]

    def token_id(self, token: str) -> int | None:
        i = int(self._sp.piece_to_id(token))
        return None if i == self._sp.unk_id() or self._sp.id_to_piece(i) != token else i

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids]))

    def save(self, directory: str) -> str:
        """Copies the model to DIRECTORY/tokenizer.model (loadable as the directory)."""
        return _save(directory, {self.path: SENTENCEPIECE_FILE})

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


class HfTokenizer:
    """A Hugging Face `tokenizer.json`, with BOS/EOS/pad from `tokenizer_config.json` beside it.

    BOS: the config's `bos_token` when `add_bos_token` is true; when the config does not say,
    the token the tokenizer's own post-processor prepends (if any). Qwen3 has none.
    EOS: the config's `eos_token`, else the first of HF_EOS_FALLBACKS in the vocabulary.
    pad: the config's `pad_token`, else EOS.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HfTokenizer

        self.path = str(path)
        config_path = os.path.join(os.path.dirname(os.path.abspath(self.path)), HF_CONFIG_FILE)
        self.config_path = config_path if os.path.isfile(config_path) else None
        self.files = [self.path] + ([config_path] if self.config_path else [])
        self.files += _chat_template_files(self.path)
        try:
            self._tok = _HfTokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises a bare Exception for a bad file
            raise ValueError(
                f"tokenizer {self.path} is not a Hugging Face tokenizer: {e}"
            ) from None
        config = self._read_config()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._eos_id(config)
        pad = _token_content(config.get("pad_token"))
        self.pad_id = self._id_of(pad, "pad_token") if pad is not None else self.eos_id
        self.bos_id = self._bos_id(config)

    def _read_config(self) -> dict[str, Any]:
        if self.config_path is None:
            return {}
        try:
            with open(self.config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {self.config_path}: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{self.config_path} is not a JSON object")
        return config

    def _id_of(self, token: str, field: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            where = self.config_path or self.path
            raise ValueError(f"{where}: {field} {token!r} is not in the vocabulary of {self.path}")
        return int(token_id)

    def _eos_id(self, config: dict[str, Any]) -> int:
        eos = _token_content(config.get("eos_token"))
        if eos is not None:
            return self._id_of(eos, "eos_token")
        for name in HF_EOS_FALLBACKS:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        raise ValueError(
            f"cannot determine the EOS token of {self.path}: no {HF_CONFIG_FILE} with an "
            f"eos_token beside it, and none of {list(HF_EOS_FALLBACKS)} is in its vocabulary"
        )

    def _bos_id(self, config: dict[str, Any]) -> int | None:
        bos = _token_content(config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is not None:
            return self._id_of(bos, "bos_token") if add_bos and bos is not None else None
        # The config does not say: prepend what the tokenizer's post-processor would prepend.
        plain = self._tok.encode("a", add_special_tokens=False).ids
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        if len(with_special) > len(plain) and with_special[1 : 1 + len(plain)] == plain:
            return int(with_special[0])
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def token_id(self, token: str) -> int | None:
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def save(self, directory: str) -> str:
        """Copies tokenizer.json (+ tokenizer_config.json) into DIRECTORY."""
        files = {self.path: HF_FILE}
        if self.config_path:
            files[self.config_path] = HF_CONFIG_FILE
        return _save(directory, files)

    def __repr__(self) -> str:
        return f"HfTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _chat_template_files(tokenizer_path: str) -> list[str]:
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), CHAT_TEMPLATE_FILE)
    return [path] if os.path.isfile(path) else []


def _save(directory: str, files: dict[str, str]) -> str:
    """Copies each tokenizer file (path -> name) into DIRECTORY, the first's chat_template.jinja
    along with them (when beside it) -> the first's copy, the path the tokenizer loads from."""
    out = epath.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for path, name in files.items():
        epath.Path(path).copy(out / name, overwrite=True)
    first = next(iter(files))
    template = epath.Path(os.path.dirname(os.path.abspath(first))) / CHAT_TEMPLATE_FILE
    if template.is_file():
        template.copy(out / CHAT_TEMPLATE_FILE, overwrite=True)
    saved: str = os.fspath(out / files[first])  # (etils.epath is untyped: Any)
    return saved


def _token_content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer at PATH: a .model file, a tokenizer.json, or a directory holding one."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path} does not exist (expected {_EXPECTED})")
    if os.path.isdir(path):
        # A directory with both (many Llama checkpoints) is read as its tokenizer.json.
        for name, cls in ((HF_FILE, HfTokenizer), (SENTENCEPIECE_FILE, SentencePieceTokenizer)):
            if os.path.isfile(os.path.join(path, name)):
                return cls(os.path.join(path, name))
        raise FileNotFoundError(
            f"tokenizer directory {path} holds neither {HF_FILE} nor {SENTENCEPIECE_FILE} "
            f"(expected {_EXPECTED})"
        )
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    if path.endswith(".json"):
        return HfTokenizer(path)
    raise ValueError(f"tokenizer {path}: unknown kind of file (expected {_EXPECTED})")


def find_tokenizer(directory: str | os.PathLike[str]) -> str | None:
    """The tokenizer saved beside a prepared dataset (its version directory), or None."""
    for name in (HF_FILE, SENTENCEPIECE_FILE):  # the order load_tokenizer reads a directory
        candidate = os.path.join(os.fspath(directory), name)
        if os.path.isfile(candidate):
            return candidate
    return None
