"""``llm_colocated``: the baseline; prefill and decode of every request in one engine loop."""

from __future__ import annotations

from typing import Any

from splitserve.triton.streaming_model import GenerateModelBase


class ColocatedModel(GenerateModelBase):
    role = "colocated"

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            taken = self.intake(request)
            if taken is not None:
                prep, sink, rid = taken
                self.loop.add_request(rid, prep.prompt_ids, prep.gen.params, sink, prep.deadline)
