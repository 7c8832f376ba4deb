"""Runs the 8-device mesh tests (`tests/multidevice/`) in a child pytest process.

XLA creates forced host devices only from `XLA_FLAGS` set before JAX starts, which this
process is past; the child sets it, so `python -m pytest` stays the one test command.
"""

import os
import pathlib
import subprocess
import sys

from multidevice_env import MULTIDEVICE_ENV

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_multidevice_suite():
    env = os.environ | {MULTIDEVICE_ENV: "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "tests/multidevice",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,  # about 9 minutes on a loaded 2-core VM (two multi-process servers)
    )
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
