"""Benchmarks, run from a checkout: `python -m benchmarks.NAME` (not installed)."""

from paxkv.launch.platform import quiet_backend_probes

quiet_backend_probes()  # no "Unable to initialize backend 'tpu'" on a CPU machine
