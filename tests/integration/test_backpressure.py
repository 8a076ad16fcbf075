"""More long requests than the KV pools hold wait and all complete; beyond ``max_queue`` they are
refused at once with UNAVAILABLE instead of hanging. (Triton 2.51 answers every error of a
decoupled model on HTTP ``generate`` with 400, so the test reads the message.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from llm_client import gauges, post, wait_for

from splitserve.deploy.launcher import TritonServer
from splitserve.deploy.spec import DeploymentSpec, RoleSpec

pytestmark = pytest.mark.triton

MAX_QUEUE = 4
MAX_TOKENS = 240
"""With the prompt, 16 of the 32 blocks of 16 tokens: two such requests fill a pool."""
ENGINE = {"model": "tiny", "max_model_len": 256, "num_kv_blocks": 32}
BOUNDED = RoleSpec(settings={"max_queue": MAX_QUEUE})
LAYOUT = DeploymentSpec(layout="both", settings=ENGINE, decode=BOUNDED, colocated=BOUNDED)
BODY = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
"""With a prompt of each request's own: identical greedy requests would share their blocks
through the prefix cache (a preempted one recomputes onto the others' cached blocks), and the
pools would never run short."""
DEADLINE_S = 120.0


def burst(server: TritonServer, model: str, n: int) -> tuple[list[tuple[int, str]], float]:
    """``n`` concurrent HTTP generate calls; their (status, body) and the peak queue depth seen."""
    peak = 0.0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.wait(0.05):
            peak = max(peak, gauges(server).get(("splitserve_queue_depth", model), 0.0))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(n) as pool:
            results = list(
                pool.map(
                    lambda i: post(server, model, "generate", {**BODY, "text_input": f"hi {i}"}),
                    range(n),
                )
            )
    finally:
        done.set()
        watcher.join()
    return results, peak


def idle(server: TritonServer, model: str) -> Callable[[], bool]:
    def check() -> bool:
        values = gauges(server)
        pools = (model, "prefill") if model == "llm" else (model,)
        return all(values[("splitserve_kv_blocks_used", pool)] == 0 for pool in pools)

    return check


def test_requests_wait_for_blocks_then_the_queue_bound_refuses(
    start_splitserve: Callable[[DeploymentSpec], TritonServer],
) -> None:
    server = start_splitserve(LAYOUT)
    for model in ("llm", "llm_colocated"):
        started = time.monotonic()
        results, peak = burst(server, model, MAX_QUEUE)
        assert [status for status, _ in results] == [200] * MAX_QUEUE, results
        assert all(f'"num_output_tokens":{MAX_TOKENS}' in body for _, body in results), results
        assert peak >= 1, "no request ever waited: the pool held them all"

        results, _ = burst(server, model, 4 * MAX_QUEUE)
        statuses = sorted(status for status, _ in results)
        assert set(statuses) == {200, 400}, results
        refused = [body for status, body in results if status == 400]
        assert all("server busy" in body and "max_queue" in body for body in refused), refused
        assert time.monotonic() - started < DEADLINE_S
        assert wait_for(idle(server, model), 10.0), gauges(server)
