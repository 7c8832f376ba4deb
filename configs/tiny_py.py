"""The byte-level toy model trained on the Python standard library (`paxkv-train`).

Its weights ship with the package (`paxkv.models.CHECKPOINTS["tiny-py"]`): it runs on
the CPU with no downloads, and writes Python-like text.
"""

from paxkv.configs.tiny import SETUP as TINY_SETUP

SETUP = TINY_SETUP.replace(name="tiny-py", random_weights=False, checkpoint="tiny-py")
