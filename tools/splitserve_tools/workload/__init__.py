"""Traffic and the yardstick shared by the bench (real servers) and the planner (simulated ones).

- ``arrivals``: open-loop arrival times (Poisson, gamma with a CV, fixed rate).
- ``lengths``: (input_len, output_len) distributions of the workloads (chatbot, code,
  summarization, fixed).
- ``slo``: the latency targets and the share of requests that meet them.
- ``search``: goodput, the highest rate whose probe meets the attainment target.
"""
