"""Soak: many mixed requests against ``llm`` and ``llm_colocated``; proves that nothing leaks.

Requests of mixed prompt and output lengths, streaming or not, ~10% cancelled at a random point
(before the first token or after a few), ~5% malformed, ``--concurrency`` at a time, spread over
the models. At the end it prints, and checks: every request ended (FINAL, an error, or the
cancel it was sent), zero KV blocks used, zero leases and zero queued requests on every
instance (from the metrics port), and each stub's RSS growth after the warm-up (10%) under 5%.
Run: python scripts/soak.py --requests 10000 --concurrency 64   (starts a server on ``tiny``)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput

from splitserve.deploy.launcher import TritonServer, free_ports
from splitserve.deploy.render import render
from splitserve.deploy.spec import default_cpu_spec
from splitserve.testing.procfs import stub_instances

MODELS = ("llm", "llm_colocated")
WORDS = [
    "the",
    "keeper",
    "of",
    "an",
    "old",
    "lighthouse",
    "wrote",
    "down",
    "every",
    "ship",
    "that",
    "passed",
    "in",
    "the",
    "night",
]
HELD = ("splitserve_kv_blocks_used", "splitserve_leases_outstanding", "splitserve_queue_depth")
SAMPLE = re.compile(r'^(splitserve_\w+)\{[^}]*instance="([^"]+)"[^}]*\} (\S+)$', re.M)
PROMPT_WORDS = (1, 4, 16, 64, 160)
MAX_TOKENS = 256
RSS_LIMIT = 0.05
RSS_SAMPLES = 8
WARMUP_FRACTION = 0.10
"""After a burst of the largest requests (``peak_plans``), long enough for every KV block to be
touched once: a pool's pages become resident as traffic first reaches them, and RSS rises
until then."""


def tensor(name: str, values: list[Any], datatype: str) -> InferInput:
    dtypes = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64}
    array = np.array(values, dtype=dtypes[datatype])
    t = InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def text(prompt: bytes) -> InferInput:
    return tensor("text_input", [prompt], "BYTES")


def sampling(params: dict[str, Any] | bytes) -> InferInput:
    raw = params if isinstance(params, bytes) else json.dumps(params).encode()
    return tensor("sampling_parameters", [raw], "BYTES")


MALFORMED: list[Callable[[], list[InferInput]]] = [
    lambda: [text(b"")],
    lambda: [text(b"caf\xe9 \xff")],
    lambda: [text(b"hi"), sampling(b"{not json")],
    lambda: [text(b"hi"), sampling({"best_temperature": 1})],
    lambda: [text(b"hi"), sampling({"max_tokens": 0})],
    lambda: [text(b"hi"), tensor("beam_width", [4], "INT32")],
    lambda: [text(b"hi"), tensor("max_tokens", [5], "INT64")],
    lambda: [tensor("stream", [True], "BOOL")],
]


@dataclass(frozen=True)
class Plan:
    model: str
    kind: str
    """``normal``, ``cancel`` or ``malformed``."""
    inputs: list[InferInput]
    cancel_after: int = 0
    """For ``cancel``: responses to read before cancelling (0: cancel after 20 ms, before or
    during prefill)."""


def make_plan(
    rng: random.Random, models: Sequence[str], cancel_frac: float, malformed_frac: float
) -> Plan:
    model = rng.choice(models)
    roll = rng.random()
    if roll < malformed_frac:
        return Plan(model, "malformed", rng.choice(MALFORMED)())
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice(PROMPT_WORDS)))
    long = rng.random() < 0.1
    params = {"max_tokens": rng.randint(64, MAX_TOKENS) if long else rng.randint(1, 24)}
    cancel = roll < malformed_frac + cancel_frac
    if cancel:
        params.update(max_tokens=512, ignore_eos=True)
    stream = cancel or rng.random() < 0.5
    inputs = [text(prompt.encode()), sampling(params), tensor("stream", [stream], "BOOL")]
    return Plan(model, "cancel" if cancel else "normal", inputs, rng.choice([0, 1, 2, 5, 20]))


def peak_plans(models: Sequence[str], concurrency: int) -> list[Plan]:
    """Requests of the largest size the soak sends, ``concurrency`` per model at once: the
    biggest batches a run can form, so the warm-up reaches the heap's high-water mark."""
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(max(PROMPT_WORDS))).encode()
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    inputs = [text(prompt), sampling(params), tensor("stream", [False], "BOOL")]
    return [Plan(model, "normal", inputs) for model in models for _ in range(concurrency)]


async def run_one(client: grpcaio.InferenceServerClient, plan: Plan, timeout_s: float) -> str:
    """How the request ended: ``final``, ``error: <message>``, ``cancelled`` or ``hung``."""

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": plan.model, "inputs": plan.inputs}

    responses = client.stream_infer(requests())

    async def consume() -> str:
        """Read the stream to its end, as a client must: one dropped with the stream still open
        can keep Triton 2.51 from ever unloading the model (``docs/reliability.md``)."""
        if plan.kind == "cancel" and plan.cancel_after == 0:
            await asyncio.sleep(0.02)
            responses.cancel()
            return "cancelled"
        outcome = "error: stream closed without FINAL"
        seen = 0
        async for result, error in responses:
            seen += 1
            if error is not None:
                outcome = f"error: {error.message()}"
            elif result.get_response().parameters["triton_final_response"].bool_param:
                outcome = "final"
            elif plan.kind == "cancel" and seen >= plan.cancel_after:
                responses.cancel()
                return "cancelled"
        return outcome

    try:
        return await asyncio.wait_for(consume(), timeout_s)
    except TimeoutError:
        responses.cancel()
        return "hung"


@dataclass
class Tally:
    ended: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """(model, plan kind, outcome kind) -> count."""
    unexpected: list[str] = field(default_factory=list)

    def add(self, plan: Plan, outcome: str) -> None:
        kind = outcome.split(":")[0]
        self.ended[(plan.model, plan.kind, kind)] += 1
        expected = {"normal": {"final"}, "malformed": {"error"}, "cancel": {"cancelled", "final"}}
        if kind not in expected[plan.kind]:
            self.unexpected.append(f"{plan.model} {plan.kind}: {outcome}")


async def drive(
    url: str, plans: list[Plan], concurrency: int, timeout_s: float, tally: Tally
) -> None:
    queue: asyncio.Queue[Plan] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)

    async def worker() -> None:
        async with grpcaio.InferenceServerClient(url) as client:
            while not queue.empty():
                plan = queue.get_nowait()
                tally.add(plan, await run_one(client, plan, timeout_s))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def held_per_instance(metrics_url: str) -> dict[str, dict[str, float]]:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        body = response.read().decode()
    held: dict[str, dict[str, float]] = {}
    for name, instance, value in SAMPLE.findall(body):
        if name in HELD:
            held.setdefault(instance, {})[name] = float(value)
    return held


def rss(pids: dict[str, int]) -> dict[str, int]:
    return {name: psutil.Process(pid).memory_info().rss for name, pid in pids.items()}


@dataclass
class Report:
    tally: Tally
    held: dict[str, dict[str, float]]
    trajectory: list[dict[str, int]]
    """RSS of every stub after the warm-up, then after each ``RSS_SAMPLES``-th of the rest."""
    seconds: float

    @property
    def rss_before(self) -> dict[str, int]:
        return self.trajectory[0]

    @property
    def rss_after(self) -> dict[str, int]:
        return self.trajectory[-1]

    @property
    def rss_growth(self) -> dict[str, float]:
        return {k: self.rss_after[k] / self.rss_before[k] - 1 for k in self.rss_before}

    @property
    def ok(self) -> bool:
        return (
            not self.tally.unexpected
            and all(v == 0 for values in self.held.values() for v in values.values())
            and all(g < RSS_LIMIT for g in self.rss_growth.values())
        )

    def table(self) -> str:
        total = sum(self.tally.ended.values())
        lines = [f"{total} requests in {self.seconds:.0f} s ({total / self.seconds:.1f}/s)", ""]
        lines.append(f"{'model':<14}{'plan':<11}{'ended as':<11}{'count':>7}")
        for (model, kind, outcome), n in sorted(self.tally.ended.items()):
            lines.append(f"{model:<14}{kind:<11}{outcome:<11}{n:>7}")
        hung = sum(n for (_, _, o), n in self.tally.ended.items() if o == "hung")
        lines += [f"hung: {hung}   unexpected outcomes: {len(self.tally.unexpected)}", ""]
        lines.append(
            f"{'instance':<20}{'blocks used':>12}{'leases':>8}{'queued':>8}"
            f"{'RSS growth':>12}   RSS MiB after warm-up, then each {RSS_SAMPLES}th"
        )
        for name in sorted(self.rss_before):
            held = self.held.get(name, {})
            mib = " ".join(f"{point[name] / 2**20:.0f}" for point in self.trajectory)
            lines.append(
                f"{name:<20}{held.get(HELD[0], float('nan')):>12.0f}"
                f"{held.get(HELD[1], float('nan')):>8.0f}{held.get(HELD[2], float('nan')):>8.0f}"
                f"{self.rss_growth[name]:>12.1%}   {mib}"
            )
        lines += ["", "PASS" if self.ok else "FAIL", *self.tally.unexpected[:20]]
        return "\n".join(lines)


def soak(
    server: TritonServer,
    requests: int,
    concurrency: int = 64,
    cancel_frac: float = 0.10,
    malformed_frac: float = 0.05,
    timeout_s: float = 120.0,
    seed: int = 0,
    settle_s: float = 10.0,
    models: Sequence[str] = MODELS,
    peak_warmup: bool = True,
) -> Report:
    """Run ``requests`` mixed requests (plus, with ``peak_warmup``, the largest ones first)
    against ``server`` and report how they ended and what the instances hold afterwards."""
    assert server.pid is not None
    rng = random.Random(seed)
    plans = [make_plan(rng, models, cancel_frac, malformed_frac) for _ in range(requests)]
    split = int(requests * WARMUP_FRACTION)
    warmup = (peak_plans(models, concurrency) if peak_warmup else []) + plans[:split]
    tally = Tally()
    started = time.monotonic()
    asyncio.run(drive(server.grpc_url, warmup, concurrency, timeout_s, tally))
    pids = stub_instances(server.pid)
    trajectory = [rss(pids)]
    rest = plans[split:]
    step = -(-len(rest) // RSS_SAMPLES)
    for i in range(0, len(rest), step):
        asyncio.run(drive(server.grpc_url, rest[i : i + step], concurrency, timeout_s, tally))
        trajectory.append(rss(pids))
    seconds = time.monotonic() - started
    deadline = time.monotonic() + settle_s
    held = held_per_instance(server.metrics_url)
    while any(v for values in held.values() for v in values.values()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        held = held_per_instance(server.metrics_url)
    return Report(tally, held, trajectory, seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cancel-frac", type=float, default=0.10)
    parser.add_argument("--malformed-frac", type=float, default=0.05)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="KV pool size per instance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = parser.parse_args()
    settings = {
        "model": args.model,
        "max_model_len": 2048,
        "num_kv_blocks": args.kv_blocks,
        "lease_ttl_s": 10.0,
    }
    workdir = Path(tempfile.mkdtemp(prefix="splitserve-soak-"))
    spec = default_cpu_spec("both", settings, lend_prefill_cores=False)
    repo = render(spec, workdir / "repo")
    http_port, grpc_port, metrics_port = free_ports(3)
    with TritonServer(
        repo,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        backend_config={"python": {"thread-pool-size": 2 * args.concurrency}},
        workdir=workdir / "triton",
    ) as server:
        report = soak(
            server,
            args.requests,
            args.concurrency,
            args.cancel_frac,
            args.malformed_frac,
            seed=args.seed,
            models=args.models,
        )
    print(report.table())
    if not report.ok:
        print(f"server log: {server.log_path}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
