"""Per-request output bookkeeping: stop conditions, incremental text, streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.request import Request, Status
from splitserve.engine.sampler import suppressed_tokens
from splitserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    """What one step produced for a request; text and ids are the new parts only."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    """Set when the request ended with an error rather than an output (``finished`` too)."""


class OutputState:
    """Detokenizes a request's tokens and decides when it stops.

    Text that could still become a stop string is held back until it cannot.
    """

    def __init__(
        self,
        req: Request,
        tokenizer: Tokenizer,
        eos_ids: tuple[int, ...],
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        self.req = req
        self.eos_ids = () if req.params.ignore_eos else eos_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.detok = IncrementalDetokenizer(
            tokenizer, req.prompt_ids, skip_special_tokens=req.params.skip_special_tokens
        )
        self.text = ""
        self._emitted_text = 0
        self._emitted_ids = 0
        self._holdback = max((len(s) for s in req.params.stop), default=1) - 1

    def suppressed(self) -> list[int]:
        """Tokens that may not be sampled yet (min_tokens not reached)."""
        return suppressed_tokens(
            self.req.params, len(self.req.output_ids), self.eos_ids, self.vocab_size
        )

    def append(self, token: int) -> None:
        req, p = self.req, self.req.params
        req.output_ids.append(token)
        start = len(self.text)
        self.text += self.detok.add(token)
        if p.stop and self._cut_at_stop_string(start):
            self._finish("stop")
            return
        if token in self.eos_ids or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        else:
            return
        self.text += self.detok.flush()
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        self.req.finish_reason = reason
        self.req.status = Status.FINISHED

    def _cut_at_stop_string(self, start: int) -> bool:
        p = self.req.params
        hits = []
        for stop in p.stop:
            idx = self.text.find(stop, max(0, start - len(stop) + 1))
            if idx >= 0:
                hits.append((idx, stop))
        if not hits:
            return False
        idx, stop = min(hits)
        self.text = self.text[: idx + len(stop) if p.include_stop_str_in_output else idx]
        return True

    def take(self) -> RequestOutput:
        """The ids and text not yet reported, as one output."""
        req = self.req
        end = (
            len(self.text)
            if req.finished
            else max(self._emitted_text, len(self.text) - self._holdback)
        )
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_ids[self._emitted_ids :],
            new_text=self.text[self._emitted_text : end],
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
        )
        self._emitted_ids = len(req.output_ids)
        self._emitted_text = end
        return out
