"""The cost runner: how long an instance's step takes, from the profile's fits.

It stands in for the engine's forward pass (``ModelRunner``): the real scheduler decides what a
step computes, this prices it. An engine step is priced in two parts, because neighbours
stretch them by different contention factors: the prompt part (prefill chunks, the fit over
their tokens and their attention pairs, the cached context included) and the decode part (the
decode fit over the batch and its context, the KV handoffs loaded for the step, and the serving
cost of every token the step sends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from splitserve.engine.scheduler import SchedulerOutput
from splitserve_tools.planner.fit import DecodeFit, HandoffFit, PrefillFit


@dataclass(frozen=True)
class StepModel:
    prefill: PrefillFit
    decode: DecodeFit
    handoff: HandoffFit
    kv_bytes_per_token: int
    block_size: int
    token_s: float
    """Serving cost of one streamed token, charged to the step that samples it."""
    source_prefill: PrefillFit | None = None
    """The prefill fit of the passes that hand KV to this instance (a disaggregated decode
    instance's prefill role, whose units may differ): what a streamed handoff overlaps.
    None: this instance's own."""
    pass_factor: float = 1.0
    """A served prompt pass over the fit's (``ServingOverhead.pass_factor``)."""
    stream_pass_factor: float = 1.0
    """And again for a pass that streams its KV (``ServingOverhead.stream_pass_factor``)."""

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def _served(self, seconds: float, streams: bool) -> float:
        return seconds * self.pass_factor * (self.stream_pass_factor if streams else 1.0)

    def prompt_pass(self, input_lens: Sequence[int], cached: Sequence[int] = ()) -> float:
        """One packed pass over prompts (the prefill role), each computing all but its first
        ``cached`` tokens (served from the prefix cache; none where ``cached`` is short),
        whose attention reads them too; it streams if any of its prompts does."""
        hits = [*cached, *[0] * (len(input_lens) - len(cached))]
        new = [n - c for n, c in zip(input_lens, hits, strict=True)]
        pairs = sum(k * k + 2 * k * c for k, c in zip(new, hits, strict=True))
        seconds = self.prefill(sum(new), pairs)
        return self._served(seconds, any(map(self.handoff.streams, input_lens)))

    def loaded_s(self, blocks: int, prompt_blocks: int | None = None) -> float:
        """What loading ``blocks`` blocks of a handed-over prompt adds after its pass. The
        prompt, ``prompt_blocks`` long (default ``blocks``; more where decode had some of its
        blocks cached), decides whether its KV streamed and how long the pass it overlapped
        ran; lengths are taken as whole blocks."""
        tokens = (blocks if prompt_blocks is None else prompt_blocks) * self.block_size
        nbytes = blocks * self.block_bytes
        if not self.handoff.streams(tokens):
            return self.handoff(nbytes)
        pass_s = self._served((self.source_prefill or self.prefill)(tokens, tokens * tokens), True)
        return self.handoff.added_after_pass(nbytes, pass_s)

    def engine_step(
        self, out: SchedulerOutput, loaded: Sequence[tuple[int, int]]
    ) -> tuple[float, float]:
        """(prompt part, decode part) of a step that runs ``out`` after loading handed-over KV:
        (blocks pulled, blocks of the prompt) per request; call before the step updates the
        requests."""
        decode_s = sum(self.loaded_s(pulled, prompt) for pulled, prompt in loaded)
        if out.decodes:
            context = sum(map(attrgetter("num_tokens"), out.decodes))
            decode_s += self.decode(len(out.decodes), context)
        prefill_s = 0.0
        finishing = 0
        if out.prefills:
            tokens = sum(n for _, n in out.prefills)
            pairs = sum(n * n + 2 * n * req.num_computed for req, n in out.prefills)
            prefill_s = self._served(self.prefill(tokens, pairs), False)
            finishing = sum(1 for req, n in out.prefills if req.num_computed + n == req.num_tokens)
        decode_s += self.token_s * (len(out.decodes) + finishing)
        return prefill_s, decode_s
