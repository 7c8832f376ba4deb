"""Tools over the library: capacity planning, workloads and the load benchmark, quality, the demo."""
