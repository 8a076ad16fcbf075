"""Timing the engine's own prefill and decode steps in this process.

Prefill runs the prefill role's path (``PrefillEngine.prefill``: one packed pass and sampling).
Decode runs ``Engine.step`` over requests admitted as handed over, with their KV blocks left as
they are: a step's time does not depend on the values in the cache, so no prompt is computed
to reach a long context.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from splitserve.engine.build import Components, build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine.prompt_pass import PrefillEngine
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine_config import EngineConfig
from splitserve.kv.layout import DTYPES, KVLayout
from splitserve.kv.pool import KVPool
from splitserve_kernels import cpu as kernels_cpu
from splitserve_tools.planner.fit import (
    DecodeSample,
    HandoffFit,
    PrefillSample,
    fit_decode,
    fit_handoff,
    fit_prefill,
)
from splitserve_tools.planner.profile import ModelShape, Rates, UnitProfile


@dataclass(frozen=True)
class Points:
    """Where to measure. Prefill batches of more than ``max_prefill_tokens`` are skipped."""

    prefill_lengths: tuple[int, ...] = (32, 128, 512, 1024, 2000)
    prefill_batches: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 4, 16, 64)
    decode_contexts: tuple[int, ...] = (64, 512, 1536)
    decode_steps: int = 8
    repeats: int = 3
    max_prefill_tokens: int = 4096

    def prefill_jobs(self) -> list[tuple[int, int]]:
        return [
            (b, n)
            for n in self.prefill_lengths
            for b in self.prefill_batches
            if b * n <= self.max_prefill_tokens
        ]

    def decode_jobs(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.decode_batches for c in self.decode_contexts]

    @property
    def max_len(self) -> int:
        """A context that holds every measured prompt (which must leave room for one output
        token) and every decode context."""
        longest_prompt = max(self.prefill_lengths) + 1
        return max(longest_prompt, max(self.decode_contexts) + self.decode_steps + 2)


class _Kept:
    """A handed-over request's KV that is already in place: loading it copies nothing."""

    def load(self, dst_block_ids: list[int], skip: int = 0) -> None:
        return None

    def discard(self) -> None:
        return None


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def _median(fn: Callable[[], float], repeats: int) -> float:
    fn()
    return statistics.median(fn() for _ in range(repeats))


def time_prefill(parts: Components, batch: int, length: int, repeats: int) -> float:
    pool = KVPool(parts.layout, batch * parts.layout.blocks_for(length) + 1)
    engine = PrefillEngine(parts.model, pool, parts.eos_ids, parts.max_model_len)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = parts.model.cfg.vocab_size

    def once() -> float:
        reqs = [Request(str(i), _ids(vocab, length, i), params) for i in range(batch)]
        start = time.perf_counter()
        engine.prefill(reqs)
        seconds = time.perf_counter() - start
        for req in reqs:
            engine.free(req)
        return seconds

    return _median(once, repeats)


def time_decode(
    parts: Components, cfg: EngineConfig, batch: int, context: int, steps: int, repeats: int
) -> float:
    """Seconds per decode step of ``batch`` sequences at ``context`` tokens each (on average
    over the timed steps, ``context + steps / 2``)."""
    blocks = batch * parts.layout.blocks_for(context + steps + 2) + 1
    pool = KVPool(parts.layout, blocks)
    vocab = parts.model.cfg.vocab_size

    def once() -> float:
        limits = scheduler_limits(cfg)
        engine = Engine(parts.model, pool, parts.tokenizer, limits, parts.max_model_len)
        params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_prefilled(str(i), _ids(vocab, context, i), params, 3, i, _Kept())
        engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = (time.perf_counter() - start) / steps
        for i in range(batch):
            engine.abort(str(i))
        return seconds

    return _median(once, repeats)


def measure_unit(
    model: str, dtype: str, device: str, points: Points, progress: bool = True, desc: str = ""
) -> tuple[UnitProfile, Components]:
    """Fits for this process's threads, and the components they were measured on."""
    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        max_model_len=points.max_len,
        max_num_batched_tokens=max(4096, max(points.decode_batches)),
        max_num_seqs=max(points.decode_batches),
    )
    parts = build_components(cfg)
    jobs: list[tuple[str, int, int]] = [("prefill", b, n) for b, n in points.prefill_jobs()]
    jobs += [("decode", b, c) for b, c in points.decode_jobs()]
    prefill: list[PrefillSample] = []
    decode: list[DecodeSample] = []
    bar: Iterator[tuple[str, int, int]] = tqdm(
        jobs, desc=desc or f"profile {torch.get_num_threads()} threads", disable=not progress
    )
    with torch.inference_mode():
        for phase, batch, n in bar:
            if phase == "prefill":
                seconds = time_prefill(parts, batch, n, points.repeats)
                prefill.append(PrefillSample(batch, n, seconds))
            else:
                seconds = time_decode(parts, cfg, batch, n, points.decode_steps, points.repeats)
                context = batch * (n + points.decode_steps / 2)
                decode.append(DecodeSample(batch, context, seconds))
    unit = UnitProfile(
        threads=torch.get_num_threads(),
        prefill=fit_prefill(prefill),
        decode=fit_decode(decode),
        prefill_samples=tuple(prefill),
        decode_samples=tuple(decode),
        rates=measure_rates(device, dtype),
    )
    return unit, parts


def measure_rates(device: str, dtype: str, read_bytes: int = 1 << 30, repeats: int = 3) -> Rates:
    """The roofline of this process's threads (or of the GPU): read bandwidth of a streaming
    ``sum`` over ``read_bytes`` and FLOP/s of a 2048² matmul in ``dtype``; best of ``repeats``.
    A CPU that does not multiply ``dtype`` in hardware (``splitserve_kernels.cpu.native_matmul``)
    can widen it to float32 at float32's rate, which is then its limit: the faster of the two."""
    n = 2048
    x = torch.ones(read_bytes // 4, device=device)
    matmul_dtypes = [DTYPES[dtype]]
    if device == "cpu" and not kernels_cpu.native_matmul(DTYPES[dtype]):
        matmul_dtypes.append(torch.float32)
    operands = [
        (torch.randn(n, n, device=device).to(d), torch.randn(n, n, device=device).to(d))
        for d in matmul_dtypes
    ]

    def timed(fn: Callable[[], object]) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    matmul_s = min(timed(lambda a=a, b=b: a @ b) for a, b in operands)
    return Rates(read_bytes / timed(x.sum), 2 * n**3 / matmul_s)


def model_shape(parts: Components, max_model_len: int) -> ModelShape:
    layout = parts.layout
    weights = sum(p.numel() * p.element_size() for p in parts.model.parameters())
    return ModelShape(
        kv_bytes_per_token=layout.block_bytes // layout.block_size,
        block_size=layout.block_size,
        max_model_len=max_model_len,
        weight_bytes=weights,
    )


def _device_copy_s(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    return _median(copy, 5)


def measure_handoff(layout: KVLayout, device: str, sizes: tuple[int, ...] = (1, 32)) -> HandoffFit:
    """CPU: the shm transport end to end (verify, copy, release). GPU: a device copy of the
    same bytes (the CUDA IPC path copies within or between GPUs)."""
    points = []
    for blocks in sizes:
        nbytes = blocks * layout.block_bytes
        if device == "cpu":
            from splitserve_tools.planner.handoff_timing import bench_handoff

            seconds = bench_handoff(blocks, layout, repeats=3)["fetch_s"]
        else:
            seconds = _device_copy_s(nbytes)
        points.append((nbytes, seconds))
    return fit_handoff(points)
