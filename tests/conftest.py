"""The suite's collection: `multidevice/` runs in its own process (see test_multidevice.py).

Those tests need 8 host devices, which XLA creates only when `XLA_FLAGS` is set
before JAX starts, so this process leaves them to a child that sets it.
"""

import os

from multidevice_env import MULTIDEVICE_ENV

collect_ignore = [] if os.environ.get(MULTIDEVICE_ENV) else ["multidevice"]
