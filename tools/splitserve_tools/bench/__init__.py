"""``splitserve bench``: open-loop goodput benchmark (DistServe's metric) against Triton models or
OpenAI-compatible endpoints.

- ``target``    the Target protocol; Triton gRPC streaming target; target specs
- ``arrivals``  open-loop arrival times (Poisson, gamma with a CV, fixed rate)
- ``prompts``   prompts of an exact token length
- ``workloads`` (input_len, output_len) distributions and the requests made from them
- ``runner``    sends a schedule of requests at their arrival times, with asyncio
- ``metrics``   TTFT / TPOT / e2e percentiles and SLO attainment
- ``goodput``   binary search for the highest rate meeting the SLOs; SLO-scale sweep
- ``report``    JSON and PNG plots
- ``main``      what the ``bench`` subcommand runs
"""
