"""Offline placement planner: profile the engine, simulate placements, search for goodput.

- ``fit``: latency models (prefill a + b·tokens + c·Σlen², per-range decode, handoff) and fits.
- ``profile``: the saved profile (hardware, fits per cores/GPUs per instance) and its JSON.
- ``measure``: timing the engine's prefill and decode steps in this process.
- ``cores``: profiling at several core counts, one pinned subprocess each.
- ``gpu_model``: a modelled GPU profile from bandwidth and FLOP rate (labelled as modelled).
- ``placement``: one candidate deployment (instances, units per instance, batching limits).
- ``step_model``: the cost runner: an instance's step time from the fits.
- ``prefill_pool``: the prefill instances behind Triton's dynamic batcher, simulated.
- ``instances``: an engine instance simulated by driving the engine's own scheduler.
- ``simulate``: discrete-event simulation of a placement under a workload.
- ``search``: goodput of a placement (the workload's search over simulated runs), enumeration
  and ranking of placements.
- ``plan``: ``plan.json`` and its conversion to a deployment spec.
"""
