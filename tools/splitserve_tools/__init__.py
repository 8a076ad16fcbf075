"""Tools on top of the runtime: the workload model, the load generator, the planner."""
