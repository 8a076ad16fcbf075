"""Offline placement planner: profile the engine, simulate placements, search for goodput.

- ``fit``: latency models (prefill a + b·tokens + c·Σlen², per-range decode, handoff) and fits.
- ``profile``: the saved profile (hardware, fits per cores/GPUs per instance) and its JSON.
- ``measure``: timing the engine's prefill and decode steps in this process.
- ``cores``: profiling at several core counts, one pinned subprocess each.
- ``gpu_model``: a modelled GPU profile from bandwidth and FLOP rate (labelled as modelled).
- ``placement``: one candidate deployment (instances, units per instance, batching limits).
- ``instances``: the step model of a prefill pool and of an engine instance.
- ``simulate``: discrete-event simulation of a placement under a workload.
- ``search``: goodput by bisection over rate, enumeration and ranking of placements.
- ``plan``: ``plan.json`` and its conversion to a deployment spec.
"""
