"""Response bodies and stream chunks of the two endpoints, as plain JSON-ready dicts.

``Shape`` is what differs between ``/v1/completions`` and ``/v1/chat/completions``: object names
and how a choice carries its text.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = {"stop": "stop", "length": "length", "eos": "stop"}


def finish_reason(reason: str | None) -> str | None:
    """The server's finish reason in OpenAI's words (``stop``, ``length``)."""
    if not reason:
        return None
    return FINISH_REASONS.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Shape:
    """One endpoint's response format, with the id and creation time of one request."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.chat else "cmpl"
            object.__setattr__(self, "id", f"{prefix}-{uuid.uuid4().hex}")

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, reason: str | None, counts: dict[str, int]) -> dict[str, Any]:
        """The whole answer of a non-streaming request."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            head = self._head("chat.completion")
        else:
            choice["text"] = text
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": counts}

    def chunk(
        self, text: str | None, reason: str | None, include_usage: bool, role: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk; chat's first one carries ``role`` (and its text may be None)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            head = self._head("chat.completion.chunk")
        else:
            choice["text"] = text or ""
            head = self._head("text_completion")
        out = {**head, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": counts}
