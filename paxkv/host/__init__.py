"""The host core: page pool, prefix cache, sequences, KV-cache manager, scheduler, batch layout.

Plain Python and NumPy, run between compiled steps. Nothing here imports JAX (an
import-linter contract in pyproject.toml enforces it): the host decides, and the
device step consumes the int32 arrays it builds.
"""
