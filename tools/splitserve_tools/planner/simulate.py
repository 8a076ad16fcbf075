"""Discrete-event simulation of a placement under open-loop traffic.

Disaggregated: a request arrives at ``llm`` (instances taken in turn), waits ``request_s`` (the
adapter and the BLS call), queues at ``prefill``; when its prefill batch ends, its decode
instance sends the first token between two steps, pulls the KV when it has room and streams
the rest. Colocated: the request queues at an ``llm_colocated`` instance (in turn) whose engine
mixes its prompt pass with the running decodes. Every engine instance is driven by the
engine's own scheduler (``instances``). Traffic is the bench's (``splitserve_tools.workload``):
the same length distributions and arrival processes, with the same seeds, so a simulated run
predicts a measured one request for request. A session workload's later turns are sent
``think_s`` after the turns before them end, and their prompts repeat the earlier ones, so the
engine's prefix cache (on each instance that computes prompts, and on decode for the blocks it
need not pull) serves what it would serve in the served run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import cycle

import numpy as np

from splitserve.engine.prefix import PrefixStats
from splitserve_tools.planner.events import Clock, SimRequest
from splitserve_tools.planner.instances import EngineInstance
from splitserve_tools.planner.lending import Lending, Wider
from splitserve_tools.planner.machine import Machine
from splitserve_tools.planner.placement import Placement, Role
from splitserve_tools.planner.prefill_pool import PrefillPool
from splitserve_tools.planner.profile import Profile
from splitserve_tools.planner.step_model import StepModel
from splitserve_tools.workload.arrivals import arrival_times
from splitserve_tools.workload.lengths import workload_lengths
from splitserve_tools.workload.sessions import (
    SESSION_WORKLOADS,
    Turn,
    first_turn_arrivals,
    probe_turns,
    session_turns,
)
from splitserve_tools.workload.slo import SLO, attainment


@dataclass(frozen=True)
class Traffic:
    """The requests of one run, without their arrival times (those depend on the rate).

    With ``min_duration_s``, a run at a high rate repeats the lengths until its arrivals span
    that long (up to ``max_requests``): a fixed number of requests arriving faster than the
    system serves them is one burst, not sustained load. 0 simulates exactly ``lengths``, as
    the bench sends them."""

    lengths: tuple[tuple[int, int], ...]
    arrival: str = "poisson"
    cv: float = 1.0
    seed: int = 0
    min_duration_s: float = 0.0
    max_requests: int = 20000
    sessions: str | None = None
    """A session workload (``workload.sessions``): the run is its turns, as many as the
    bench's probe at that rate sends; ``lengths`` are those of its first ``len(lengths)``."""
    max_model_len: int = 0
    """Of a session workload's turns."""

    @classmethod
    def of_workload(
        cls,
        workload: str,
        num_requests: int,
        max_model_len: int,
        seed: int = 0,
        arrival: str = "poisson",
        cv: float = 1.0,
        input_len: int | None = None,
        output_len: int | None = None,
        min_duration_s: float = 0.0,
    ) -> Traffic:
        if workload in SESSION_WORKLOADS:
            turns = session_turns(workload, num_requests, max_model_len, seed)
            firsts = tuple((t.input_len, t.output_len) for t in turns)
            return cls(firsts, arrival, cv, seed, min_duration_s, 20000, workload, max_model_len)
        lengths = workload_lengths(
            workload, num_requests, max_model_len, seed, input_len=input_len, output_len=output_len
        )
        return cls(tuple(lengths), arrival, cv, seed, min_duration_s)

    def _count(self, rate: float, least: int) -> int:
        wanted = math.ceil(rate * self.min_duration_s)
        return max(least, min(wanted, self.max_requests))

    def requests_at(self, rate: float) -> list[SimRequest]:
        """The requests of a run at ``rate``, their arrival times set (a later turn of a
        session: when it is sent)."""
        if self.sessions is not None:
            count = self._count(rate, probe_turns(len(self.lengths), rate))
            return session_requests(
                session_turns(self.sessions, count, self.max_model_len, self.seed),
                rate,
                self.arrival,
                self.seed,
                self.cv,
            )
        count = self._count(rate, len(self.lengths))
        reps = -(-count // len(self.lengths))
        lengths = (list(self.lengths) * reps)[:count]
        times = arrival_times(self.arrival, rate, count, self.seed, self.cv)
        return [
            SimRequest(i, float(t), inp, out)
            for i, ((inp, out), t) in enumerate(zip(lengths, times, strict=True))
        ]


def session_requests(
    turns: Sequence[Turn], rate: float, arrival: str, seed: int, cv: float
) -> list[SimRequest]:
    """The turns as the bench sends them (``bench.main.schedule``): sessions arrive at the rate
    that sends ``rate`` turns/s, each later turn after the one it follows. A prompt's tokens
    are one id per segment (the system prompt shared by all sessions, every other message and
    reply its session's), so two prompts share exactly the blocks the bench's texts share,
    up to the merges of BPE across segment boundaries."""
    start = first_turn_arrivals([t.follows for t in turns], rate, arrival, seed, cv)
    ids: dict[tuple[int, int], int] = {}
    reqs = []
    for i, t in enumerate(turns):
        prompt: list[int] = []
        for pos, n in enumerate(t.segments):
            key = (0, 0) if pos == 0 else (t.session + 1, pos)
            prompt += [ids.setdefault(key, len(ids) + 1)] * n
        reqs.append(
            SimRequest(
                i,
                start.get(i, math.nan),
                t.input_len,
                t.output_len,
                prompt=tuple(prompt),
                follows=t.follows,
                think_s=t.think_s,
            )
        )
    return reqs


@dataclass(frozen=True)
class SimResult:
    """Per request, in arrival order; NaN where a request never got that far (and for the TPOT
    of one-token requests, as the bench counts them)."""

    rate: float
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    output_len: np.ndarray
    prefix: PrefixStats
    """The prefix caches' lookups, summed over the instances that compute prompts."""

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from a prefix cache over those looked up (0 with none)."""
        return self.prefix.hits / self.prefix.queries if self.prefix.queries else 0.0

    def attainment(self, ttft_slo: float, tpot_slo: float) -> float:
        return attainment(self.ttft, self.tpot, np.isfinite(self.e2e), SLO(ttft_slo, tpot_slo))


def step_model(profile: Profile, role: Role, source: Role | None = None) -> StepModel:
    """The step times of one of ``role``'s instances, whose handed-over KV comes from passes
    on ``source``'s instances (a disaggregated decode role's prefill role). On CPUs a streamed
    token costs a step its serving cost once per core: that work (the sender thread,
    tritonserver, the client) preempts one thread of the instance's OpenMP team while the
    others wait at the barrier."""
    unit = profile.unit(role.units)
    per_core = role.units if profile.device == "cpu" else 1
    return StepModel(
        prefill=unit.prefill,
        decode=unit.decode,
        handoff=profile.handoff,
        kv_bytes_per_token=profile.shape.kv_bytes_per_token,
        block_size=profile.shape.block_size,
        token_s=profile.serving.token_s * per_core,
        source_prefill=None if source is None else profile.unit(source.units).prefill,
        pass_factor=profile.serving.pass_factor,
        stream_pass_factor=profile.serving.stream_pass_factor,
    )


def pool_blocks(profile: Profile, kv_cache_bytes: int, lengths: Sequence[tuple[int, int]]) -> int:
    """Blocks of each instance's KV pool: as the engine sizes it, but no more than the run's
    requests fill all at once. A larger pool refuses no block either, so it schedules the same;
    allocating it would cost a GPU-sized simulation more than the run itself."""
    block_size = profile.shape.block_size
    served = max(1, kv_cache_bytes // (profile.shape.kv_bytes_per_token * block_size))
    return min(served, sum(-(-(inp + out) // block_size) for inp, out in lengths))


def simulate(
    profile: Profile, placement: Placement, reqs: Sequence[SimRequest]
) -> tuple[Sequence[SimRequest], PrefixStats]:
    """Run the placement over ``reqs``; returns them, finished or not, and the prefix caches'
    lookups. Prefix caching is simulated where the limits turn it on and prompts share
    prefixes (``SimRequest.prompt``); other prompts could not hit."""
    clock = Clock()
    machine = Machine(profile.contention, placement.devices)
    lim = placement.limits
    delay = profile.serving.request_s
    blocks = pool_blocks(profile, lim.kv_cache_bytes, [(r.input_len, r.output_len) for r in reqs])
    caching = lim.prefix_cache and any(r.prompt is not None for r in reqs)
    submit: Callable[[SimRequest], None]

    if placement.mode == "disagg":
        assert placement.prefill is not None and placement.decode is not None
        decode = placement.decode
        decoders = [
            EngineInstance(
                clock,
                machine,
                decode.units,
                step_model(profile, decode, placement.prefill),
                lim,
                blocks,
                caching,
            )
            for _ in range(decode.instances)
        ]
        owner: dict[int, EngineInstance] = {}
        lending = _lending(profile, placement)
        if lending is not None:
            decoders[0].attach(lending)
        pool = PrefillPool(
            clock,
            machine,
            placement.prefill.instances,
            placement.prefill.units,
            step_model(profile, placement.prefill),
            lim,
            blocks,
            lambda req, release: owner[req.idx].add_prefilled(req, release),
            caching,
            lending,
        )
        turn = cycle(decoders)

        def submit(req: SimRequest) -> None:
            owner[req.idx] = next(turn)
            pool.submit(req)

        computing: Sequence[PrefillPool | EngineInstance] = [pool]
    else:
        assert placement.colocated is not None
        role = placement.colocated
        model = step_model(profile, role)
        engines = [
            EngineInstance(clock, machine, role.units, model, lim, blocks, caching)
            for _ in range(role.instances)
        ]
        next_engine = cycle(engines)

        def submit(req: SimRequest) -> None:
            next(next_engine).add_prompt(req)

        computing = engines

    for req in reqs:
        if req.follows is None:
            clock.at(req.arrival + delay, partial(submit, req))
        else:
            reqs[req.follows].on_finish = partial(_send_after, clock, req, delay, submit)
    clock.run()
    return reqs, PrefixStats.total(part.prefix_stats for part in computing)


def _lending(profile: Profile, placement: Placement) -> Lending | None:
    """The cores lent between the roles, where the server lends them: a CPU split of one
    prefill and one decode instance (each direction where the profile has fits for both
    roles' cores together)."""
    p, d = placement.prefill, placement.decode
    if not placement.limits.lend_cores or profile.device != "cpu" or p is None or d is None:
        return None
    if p.instances != 1 or d.instances != 1 or p.units + d.units not in profile.units:
        return None
    both = Role(1, p.units + d.units)
    return Lending(
        Wider(step_model(profile, both), both.units),
        Wider(step_model(profile, both, p), both.units),
        placement.limits.tpot_target_s,
    )


def _send_after(
    clock: Clock, req: SimRequest, delay: float, submit: Callable[[SimRequest], None], now: float
) -> None:
    """A later turn is sent ``think_s`` after the turn it follows ended."""
    req.arrival = now + req.think_s
    clock.at(req.arrival + delay, partial(submit, req))


def run(profile: Profile, placement: Placement, traffic: Traffic, rate: float) -> SimResult:
    reqs, prefix = simulate(profile, placement, traffic.requests_at(rate))
    arrival = np.array([r.arrival for r in reqs])
    first = np.array([r.first for r in reqs])
    last = np.array([r.last for r in reqs])
    out = np.array([r.output_len for r in reqs])
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (last - first) / np.maximum(out - 1, 1), math.nan)
    tpot = np.where(np.isfinite(last), tpot, math.nan)
    return SimResult(rate, first - arrival, tpot, last - arrival, out, prefix)
