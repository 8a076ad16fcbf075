"""At light load the default layout's ``llm`` decodes about as fast as ``llm_colocated``.

Served as ``splitserve serve`` deploys by default (layout ``both``, prefill lending its core to
decode), on random checkpoints of several shapes. The defect this guards against: decode's
OpenMP worker for the lent core was made on decode's own core whenever the first borrowed step
had no parallel region (it depends on the shapes and dtype), and every later decode step then
fought it for that core, 50-200x slower than colocated (issue 28). The targets take turns on
each group of one to three prompts, so both meet the machine in the same state. A round that
comes out above the bound is measured again, up to ``ROUNDS`` in all: the defect shows in every
round, while this machine's noise (two cores shared with the client and the server's threads)
moves a round's ratio by 0.15-0.3 either way around a median of 1.1-1.2 on some parts. The
test's client runs where the server's own threads do (the prefill core in this layout; a
remote client would not run here at all): left anywhere, it shares decode's one core often
enough to add ~0.3 to the ratio, while colocated's two cores absorb it (BENCHMARKS.md, "Light
load: where the client runs").
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from checkpoints import LLAMA32_SETTINGS
from llm_client import samples

from splitserve.deploy.launcher import TritonServer, free_ports
from splitserve.deploy.serve import ServeOptions, build_spec, start_server
from splitserve.testing.checkpoints import write_random_checkpoint
from splitserve_tools.bench.prompts import exact_prompts, load_bench_tokenizer
from splitserve_tools.bench.serial import client_on, groups, median_tpot, take_turns
from splitserve_tools.bench.target import TritonTarget

pytestmark = pytest.mark.triton

MAX_RATIO = 1.25
"""``llm``'s TPOT p50 over ``llm_colocated``'s, at most, in at least one round."""
ROUNDS = 5
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 128
IN_FLIGHT = (1, 2, 3)
"""Requests sent at once, by turn: light load still, but batches above one, where parallel
regions (and so the OpenMP workers) come into play."""
WARMUP_PROMPTS = 3
PROMPTS = 24

CHECKPOINTS: dict[str, tuple[dict[str, object], str]] = {
    "qwen2-fp32-gqa3-tied-3l": (
        dict(
            arch="qwen2",
            hidden_size=192,
            num_layers=3,
            num_heads=6,
            num_kv_heads=2,
            intermediate_size=512,
            tie_word_embeddings=True,
        ),
        "float32",
    ),
    "llama32-fp32-gqa4-tied-4l": (
        {
            **LLAMA32_SETTINGS,
            "hidden_size": 256,
            "num_layers": 4,
            "num_heads": 8,
            "intermediate_size": 768,
        },
        "float32",
    ),
    "llama-bf16-gqa2-untied-30l": (
        dict(
            arch="llama",
            hidden_size=128,
            num_layers=30,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=344,
            dtype="bfloat16",
        ),
        "bfloat16",
    ),
    "mistral-fp32-gqa2-untied-2l": (
        dict(arch="mistral", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
        "float32",
    ),
}


def engine_counts(server: TritonServer) -> dict[str, float]:
    """``llm``'s engine counters, for the failure message."""
    counts = {}
    for name, labels, value in samples(server):
        if labels.get("model") == "llm" and name.startswith("splitserve_engine_"):
            counts[name.removeprefix("splitserve_engine_")] = value
    return counts


async def light_load(url: str, tokenizer_dir: Path) -> list[dict[str, float]]:
    """TPOT p50 per target, one dict per round, until a round is within the bound."""
    tokenizer = load_bench_tokenizer(str(tokenizer_dir))
    prompts = exact_prompts(tokenizer, WARMUP_PROMPTS + PROMPTS, PROMPT_TOKENS)
    targets = [TritonTarget(url, "llm"), TritonTarget(url, "llm_colocated")]
    rounds: list[dict[str, float]] = []
    try:
        await take_turns(targets, groups(prompts[:WARMUP_PROMPTS], IN_FLIGHT), OUTPUT_TOKENS)
        turns = groups(prompts[WARMUP_PROMPTS:], IN_FLIGHT)
        while len(rounds) < ROUNDS and not any(ratio(r) <= MAX_RATIO for r in rounds):
            records = await take_turns(targets, turns, OUTPUT_TOKENS)
            rounds.append({name: median_tpot(rs) for name, rs in records.items()})
    finally:
        for target in targets:
            await target.close()
    return rounds


def ratio(tpot: dict[str, float]) -> float:
    return tpot["llm"] / tpot["llm_colocated"]


def milliseconds(tpot: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds * 1e3, 2) for name, seconds in tpot.items()}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_llm_decodes_as_fast_as_colocated_at_light_load(name: str, tmp_path: Path) -> None:
    settings, dtype = CHECKPOINTS[name]
    ckpt = write_random_checkpoint(tmp_path / "ckpt", **settings)  # type: ignore[arg-type]
    http_port, grpc_port, metrics_port = free_ports(3)
    opts = ServeOptions(
        model=str(ckpt),
        settings={"dtype": dtype, "max_model_len": "512"},
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        host="127.0.0.1",
    )
    server = start_server(build_spec(opts), tmp_path / "repo")
    try:
        with client_on(server.server_cores):
            rounds = asyncio.run(light_load(server.grpc_url, ckpt))
        counts = engine_counts(server)
    finally:
        server.stop()
    seen = "; ".join(f"{milliseconds(r)} (x{ratio(r):.2f})" for r in rounds)
    print(f"{name}: TPOT p50 ms by round: {seen}")
    assert min(map(ratio, rounds)) <= MAX_RATIO, f"{name}: {seen}; llm engine {counts}"
