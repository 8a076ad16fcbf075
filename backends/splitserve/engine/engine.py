"""The continuous-batching engine: schedule, run, postprocess."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import torch

from splitserve.engine.build import eos_ids
from splitserve.engine.output import OutputState, RequestOutput
from splitserve.engine.prefix import PrefixCache
from splitserve.engine.request import Request, Status
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampler import sample
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import KVSource, Scheduler, SchedulerLimits, StreamedSource
from splitserve.engine.validate import validate_prompt
from splitserve.kv.block_hash import layout_key
from splitserve.kv.pool import KVPool
from splitserve.model.llama import LlamaForCausalLM
from splitserve.tokenizer import Tokenizer

PULL_WAIT_S = 0.005
"""How long a step with nothing to run but loads in flight waits for one to end."""


class Engine:
    """Prefills and decodes requests in one loop; also admits requests prefilled elsewhere."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        tokenizer: Tokenizer,
        limits: SchedulerLimits,
        max_model_len: int,
        puller: Executor | None = None,
    ) -> None:
        """``puller``: where handed-over requests' KV is loaded (see ``Scheduler``); None: in
        the step that admits them."""
        self.runner = ModelRunner(model, pool)
        prefix = None
        if limits.prefix_cache:
            prefix = PrefixCache(pool.allocator, limits.block_size, layout_key(pool.layout))
        self.scheduler = Scheduler(pool.allocator, limits, puller, prefix)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids(tokenizer, model.cfg)
        self.vocab_size = model.cfg.vocab_size
        self.max_model_len = max_model_len
        self.block_size = pool.layout.block_size
        self.states: dict[str, OutputState] = {}

    def has_unfinished(self) -> bool:
        """Requests to step, or loads of dropped requests still to settle."""
        return bool(self.states) or self.scheduler.pulls_outstanding

    def _new_state(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already running")
        validate_prompt(prompt_ids, self.vocab_size, self.max_model_len)
        req = Request(request_id, list(prompt_ids), params)
        self.states[request_id] = OutputState(
            req, self.tokenizer, self.eos_ids, self.vocab_size, self.max_model_len
        )
        return req

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add(self._new_state(request_id, prompt_ids, params))

    def add_prefilled(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        first_token: int,
        seed: int,
        source: KVSource,
    ) -> RequestOutput:
        """Admit a request whose prompt KV another engine computed and whose first token it
        sampled. ``source.load`` copies that KV in once blocks are free here; if the request
        ends first (on its first token, or aborted while waiting), ``source.discard`` is called."""
        req = self._handed_over(request_id, prompt_ids, params, seed, source)
        state = self.states[request_id]
        state.append(first_token)
        out = state.take()
        if req.finished:
            del self.states[request_id]
            source.discard()
        else:
            self.scheduler.add_prefilled(req, source)
        return out

    def add_streaming(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        source: StreamedSource,
    ) -> None:
        """Admit a request whose prompt another engine is still computing: ``source`` pulls
        its KV as it is written; ``first_token`` delivers the token that pass samples. Needs a
        puller. If the request ends before its pull starts, ``source.discard`` is called."""
        if self.scheduler.puller is None:
            source.discard()
            raise ValueError("streamed KV needs an engine with a puller")
        req = self._handed_over(request_id, prompt_ids, params, seed, source)
        self.scheduler.add_prefilled(req, source)

    def _handed_over(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        source: KVSource | StreamedSource,
    ) -> Request:
        """The state of a request whose prompt is computed elsewhere (the source discarded if
        the request is refused)."""
        try:
            req = self._new_state(request_id, prompt_ids, params)
        except ValueError:
            source.discard()
            raise
        req.seed = seed
        req.num_computed = len(prompt_ids)
        return req

    def first_token(self, request_id: str, token: int) -> RequestOutput | None:
        """The first token of a streamed request, sampled by the pass that computed its prompt;
        None if the request is gone or already has one (its prompt was recomputed here)."""
        state = self.states.get(request_id)
        if state is None or state.req.output_ids or not self.scheduler.is_handed_over(state.req):
            return None
        state.append(token)
        out = state.take()
        if state.req.finished:
            self.scheduler.remove(state.req)
            del self.states[request_id]
        return out

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. False if it is unknown."""
        state = self.states.pop(request_id, None)
        if state is None:
            return False
        req = state.req
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        return True

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        outputs = [self._failed(req, why) for req, why in self.scheduler.failed]
        self.scheduler.failed.clear()
        if plan.empty and not outputs and self.scheduler.pulls_outstanding:
            self.scheduler.wait_for_pulls(PULL_WAIT_S)
        if plan.decodes:
            logits = self.runner.decode(plan.decodes)
            self._commit(plan.decodes)
            outputs += self._postprocess(plan.decodes, logits)
        if plan.prefills:
            logits = self.runner.prefill(plan.prefills)
            self._commit([r for r, _ in plan.prefills])
            done = [i for i, (r, _) in enumerate(plan.prefills) if r.num_computed == r.num_tokens]
            if done:
                reqs = [plan.prefills[i][0] for i in done]
                outputs += self._postprocess(reqs, logits[done])
        return outputs

    def _commit(self, reqs: Sequence[Request]) -> None:
        """Cache the blocks this step filled (before any request ends and frees them)."""
        if (prefix := self.scheduler.prefix) is not None:
            for req in reqs:
                prefix.commit(req)

    def _failed(self, req: Request, why: str) -> RequestOutput:
        del self.states[req.request_id]
        return RequestOutput(
            req.request_id, [], "", True, "error", len(req.prompt_ids), len(req.output_ids), why
        )

    def _postprocess(self, reqs: Sequence[Request], logits: torch.Tensor) -> list[RequestOutput]:
        states = [self.states[r.request_id] for r in reqs]
        suppress = [s.suppressed() for s in states]
        tokens = sample(logits, reqs, suppress)
        outputs = []
        for state, token in zip(states, tokens, strict=True):
            state.append(token)
            outputs.append(state.take())
            req = state.req
            if req.finished:
                self.scheduler.remove(req)
                del self.states[req.request_id]
        return outputs
