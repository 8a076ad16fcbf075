"""``splitserve bench``: open-loop goodput benchmark (DistServe's metric) against Triton models or
OpenAI-compatible endpoints.

- ``target``    the Target protocol; Triton gRPC streaming target; target specs
- ``prompts``   prompts of an exact token length
- ``requests``  the requests made from a workload's lengths (``splitserve_tools.workload``)
- ``runner``    sends a schedule of requests at their arrival times, with asyncio
- ``metrics``   TTFT / TPOT / e2e percentiles and SLO attainment of recorded requests
- ``goodput``   probes of a real target for the goodput search; SLO-scale sweep
- ``report``    JSON and PNG plots
- ``main``      what the ``bench`` subcommand runs
"""
