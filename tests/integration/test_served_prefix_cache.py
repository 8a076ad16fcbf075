"""Prefix caching through a real tritonserver: prompts that share a system prompt, and a
conversation whose every turn repeats the last, give ``llm`` (its ``prefill`` reuses the cache)
and ``llm_colocated`` the offline engine's and transformers' greedy text, and the cache's
counters and gauges show the reuse."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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


SKIPPED = "splitserve_kv_handoff_blocks_skipped_total"


def total(server: TritonServer, name: str, model: str) -> float:
    return sum(v for n, labels, v in samples(server) if n == name and labels["model"] == model)


def counts(server: TritonServer, model: str) -> tuple[float, float]:
    """(queries, hits) of ``model``, summed over its instances."""
    return total(server, QUERIES, model), total(server, HITS, model)


def generate(server: TritonServer, model: str, prompt: str) -> str:
    with GrpcStream(server.grpc_url) as client:
        return client.generate(model, generate_inputs(prompt, stream=True, sampling=GREEDY)).text


@pytest.mark.parametrize("model", list(PREFILLERS))
def test_shared_prefixes_and_turns_give_the_reference_text_and_hit_the_cache(
    splitserve_server: TritonServer, greedy_reference: ReferenceFactory, model: str
) -> None:
    source = PREFILLERS[model]
    queries0, hits0 = counts(splitserve_server, source)
    skipped0 = total(splitserve_server, SKIPPED, "llm")
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
    assert wait_for(lambda: counts(splitserve_server, source)[0] - queries0 >= tokens, 5.0)
    queries, hits = counts(splitserve_server, source)
    assert queries - queries0 == tokens
    # Every prompt after the first repeats at least the system prompt's first block.
    assert BLOCK * (len(prompts) - 1) <= hits - hits0 < tokens
    if model == "llm":  # decode pulled none of the blocks it had cached from earlier prompts
        assert wait_for(lambda: total(splitserve_server, SKIPPED, "llm") > skipped0, 5.0)
    assert gauges(splitserve_server)[("splitserve_kv_blocks_cached", source)] > 0


@pytest.mark.parametrize("model", list(PREFILLERS))
def test_concurrent_prompts_behind_one_system_prompt_share_its_blocks(
    splitserve_server: TritonServer, greedy_reference: ReferenceFactory, model: str
) -> None:
    """Prompts in flight together hold the same cached blocks (several leases of prefill's at
    once, in ``llm``); each gets its own text, and every block is free again after."""
    generate(splitserve_server, model, SYSTEM + "Warm the cache.")
    prompts = [SYSTEM + f"Question {i}: which lamp burned in year {1900 + i}?" for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: generate(splitserve_server, model, p), prompts))
    assert got == [greedy_reference(p, MAX_TOKENS, True).text for p in prompts]
    used = ("splitserve_kv_blocks_used", PREFILLERS[model])
    assert wait_for(lambda: gauges(splitserve_server)[used] == 0, 5.0)
