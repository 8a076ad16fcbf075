"""What ``llm`` and ``llm_colocated`` share: an engine loop, a sender thread, request intake."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import triton_python_backend_utils as pb_utils

from splitserve.engine.build import Components, build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.kv.pool import KVPool
from splitserve.serving.config import ServingConfig
from splitserve.serving.frontend import Prepared, prepare
from splitserve.serving.inputs import InputError
from splitserve.serving.loop import EngineLoop
from splitserve.triton.metrics import InstanceMetrics
from splitserve.triton.setup import setup_instance
from splitserve.triton.sink import SenderThread, TritonSink
from splitserve.triton.tensors import FINAL, error_response, request_inputs

log = logging.getLogger(__name__)


class GenerateModelBase:
    """A decoupled model that streams generated text from one engine loop per instance."""

    role = ""

    def initialize(self, args: dict[str, Any]) -> None:
        self.cfg: ServingConfig = setup_instance(args, self.role)
        self.parts: Components = build_components(self.cfg.engine)
        pool = self.make_pool()
        engine = Engine(
            self.parts.model,
            pool,
            self.parts.tokenizer,
            scheduler_limits(self.cfg.engine),
            self.parts.max_model_len,
        )
        self.metrics = InstanceMetrics(
            args, pool.allocator, min_interval_s=self.cfg.metrics_interval_s
        )
        self.sender = SenderThread()
        self.loop = EngineLoop(
            engine,
            self.cfg.cancel_poll_s,
            name=f"{self.role}-engine",
            after_step=lambda loop: self.metrics.update(
                loop.num_active, loop.engine.scheduler.num_handoff_failures
            ),
        )
        self.loop.start()

    def make_pool(self) -> KVPool:
        return self.parts.new_pool()

    def intake(self, request: Any) -> tuple[Prepared, TritonSink, str] | None:
        """Parse and validate; on bad input answer INVALID_ARG + FINAL and return None."""
        sender = request.get_response_sender()
        try:
            prep = prepare(
                request_inputs(request),
                self.parts.tokenizer,
                self.parts.max_model_len,
                self.cfg.default_max_tokens,
            )
        except InputError as exc:
            sender.send(error_response(str(exc)), flags=FINAL)
            return None
        return prep, TritonSink(sender, prep.gen, self.sender), uuid.uuid4().hex

    def finalize(self) -> None:
        self.loop.stop()
        self.sender.stop()
        self.metrics.close()
        log.info("%s finalized", self.role)


__all__ = ["FINAL", "GenerateModelBase", "pb_utils"]
