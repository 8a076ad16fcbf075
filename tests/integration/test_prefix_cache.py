"""Prefix caching through a real tritonserver: prompts that share a system prompt, and a
conversation whose every turn repeats the last, give ``llm`` (its ``prefill`` reuses the cache)
and ``llm_colocated`` the offline engine's and transformers' greedy text, and the cache's
counters and gauges show the reuse."""

from __future__ import annotations

import pytest
from llm_client import GrpcStream, ReferenceFactory, gauges, generate_inputs, samples, wait_for

from splitserve.deploy.launcher import TritonServer

pytestmark = pytest.mark.triton

SYSTEM = (
    "You are a careful assistant for a lighthouse museum. Answer in one short sentence, name "
    "the keeper when you can, and never invent dates that the visitor did not give you. "
)
QUESTIONS = ("Who kept the light in winter?", "Which lamp did they use?", "Was it ever dark?")
MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
PREFILLERS = {"llm": "prefill", "llm_colocated": "llm_colocated"}
"""Which model's instances compute the prompts of each served model."""


BLOCK = 16
"""The session server's KV block size (the engine's default)."""
QUERIES, HITS = "splitserve_prefix_cache_queries_total", "splitserve_prefix_cache_hits_total"


def counts(server: TritonServer, model: str) -> tuple[float, float]:
    """(queries, hits) of ``model``, summed over its instances."""
    got = {QUERIES: 0.0, HITS: 0.0}
    for name, labels, value in samples(server):
        if name in got and labels["model"] == model:
            got[name] += value
    return got[QUERIES], got[HITS]


def generate(server: TritonServer, model: str, prompt: str) -> str:
    with GrpcStream(server.grpc_url) as client:
        return client.generate(model, generate_inputs(prompt, stream=True, sampling=GREEDY)).text


@pytest.mark.parametrize("model", list(PREFILLERS))
def test_shared_prefixes_and_turns_give_the_reference_text_and_hit_the_cache(
    splitserve_server: TritonServer, greedy_reference: ReferenceFactory, model: str
) -> None:
    source = PREFILLERS[model]
    queries0, hits0 = counts(splitserve_server, source)
    conversation = SYSTEM
    prompts = [SYSTEM + q for q in QUESTIONS]
    for question in QUESTIONS:
        conversation += question
        prompts.append(conversation)
        conversation += greedy_reference(conversation, MAX_TOKENS, True).text + " "
    for prompt in prompts:
        want = greedy_reference(prompt, MAX_TOKENS, True)
        assert generate(splitserve_server, model, prompt) == want.text
    tokens = sum(len(greedy_reference(p, MAX_TOKENS, True).prompt_ids) for p in prompts)
    # Every prompt after the first repeats at least the system prompt's first block.
    least = BLOCK * (len(prompts) - 1)
    assert wait_for(lambda: counts(splitserve_server, source)[1] - hits0 >= least, 5.0)
    queries, hits = counts(splitserve_server, source)
    assert queries - queries0 == tokens
    assert hits - hits0 < tokens
    assert gauges(splitserve_server)[("splitserve_kv_blocks_cached", source)] > 0
