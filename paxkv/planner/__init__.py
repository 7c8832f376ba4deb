"""The capacity planner, without JAX: parameter and KV byte counts from a model's config,
device budgets, request-length workloads, and the report `paxkv-plan` prints."""
