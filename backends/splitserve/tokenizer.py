"""Tokenizers: Hugging Face ``tokenizer.json`` when the checkpoint has one, else raw UTF-8 bytes."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import tokenizers

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258
BYTE_VOCAB_SIZE = 259
BYTE_SPECIAL_TEXT: dict[int, str] = {BYTE_BOS_ID: "<s>", BYTE_EOS_ID: "</s>", BYTE_PAD_ID: "<pad>"}


class Tokenizer(ABC):
    """Text <-> token ids for one checkpoint."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with BOS (and EOS) where the checkpoint adds them."""

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary decode to nothing, bad UTF-8 to U+FFFD."""

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (tokenizer EOS first, then generation config's)."""

    @property
    @abstractmethod
    def pad_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included; the model's may be larger."""


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are UTF-8 bytes; then BOS, EOS, PAD."""

    def encode(self, text: str) -> list[int]:
        return [BYTE_BOS_ID, *text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            elif i in BYTE_SPECIAL_TEXT and not skip_special_tokens:
                parts.append(run.decode("utf-8", errors="replace"))
                parts.append(BYTE_SPECIAL_TEXT[i])
                run.clear()
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    @property
    def bos_token_id(self) -> int:
        return BYTE_BOS_ID

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (BYTE_EOS_ID,)

    @property
    def pad_token_id(self) -> int:
        return BYTE_PAD_ID

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE


class HFTokenizer(Tokenizer):
    """``tokenizer.json`` run by the ``tokenizers`` library, configured like ``AutoTokenizer``.

    When ``tokenizer_config.json`` sets ``add_bos_token``/``add_eos_token``, those decide (as
    transformers 4's Llama tokenizer did; transformers 5 ignores them once ``tokenizer.json``
    exists); otherwise the post-processor in ``tokenizer.json`` adds what it adds.
    """

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        self._tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        model_cfg = _read_json(path / "config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        self._explicit = "add_bos_token" in tok_cfg or "add_eos_token" in tok_cfg
        self._add_bos = bool(tok_cfg.get("add_bos_token", False))
        self._add_eos = bool(tok_cfg.get("add_eos_token", False))
        self._bos = self._token_id(tok_cfg.get("bos_token"))
        if self._bos is None:
            self._bos = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
        self._pad = self._token_id(tok_cfg.get("pad_token"))
        eos = [self._token_id(tok_cfg.get("eos_token"))]
        eos += _as_list(gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id")))
        self._eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))

    def _token_id(self, token: str | dict[str, Any] | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        if not self._explicit:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._add_bos and self._bos is not None:
            ids.insert(0, self._bos)
        if self._add_eos and self._eos_ids:
            ids.append(self._eos_ids[0])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """``HFTokenizer`` when ``model_dir/tokenizer.json`` exists, else ``ByteTokenizer``."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    return ByteTokenizer()


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas, holding back incomplete characters.

    Each step decodes only a short window (vLLM's prefix/read offsets): the text of the window's
    first part is known, so the new text is what the whole window adds to it. A window whose text
    ends in U+FFFD may still be half a character and waits for the next id. A few prompt ids lead
    the first window, so tokenizers that drop a leading space at the start of a text keep it.
    """

    CONTEXT_IDS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-self.CONTEXT_IDS :])
        self._prefix_text = self._decode(self._ids)
        if "\ufffd" in self._prefix_text:
            self._ids, self._prefix_text = [], ""
        self._read_offset = len(self._ids)
        self._parts: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one id; return the text that became final (often empty while bytes are held)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back, with U+FFFD for bytes that never formed a character."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(final=True)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _advance(self, final: bool) -> str:
        new_text = self._decode(self._ids)
        if not final and (len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd")):
            return ""
        delta = new_text[len(self._prefix_text) :]
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._parts.append(delta)
        return delta


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
