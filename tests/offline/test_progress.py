"""Log records while a tqdm bar is open start their own line (`paxkv.offline.progress`).

In an absl app (a subprocess: absl's handler is installed by `app.run`), a record
logged while a bar is open must not follow the bar's text on its line; without
`logging_above_bars` it does, which shows the test can fail.
"""

import os
import subprocess
import sys

import pytest

APP = """
import contextlib, sys
from absl import app, logging
from tqdm import tqdm
from paxkv.offline.progress import logging_above_bars

def main(argv):
    safe = logging_above_bars() if argv[1] == "safe" else contextlib.nullcontext()
    with tqdm(total=3, desc="bar", mininterval=0) as bar, safe:
        bar.update(1)
        logging.info("RECORD-1")
        with logging_above_bars():  # nested: still one copy of each record
            logging.warning("RECORD-2")
        bar.update(1)
    logging.info("RECORD-3")

app.run(main)
"""


def _stderr(mode: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", APP, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def _records_at_line_start(stderr: str) -> list[bool]:
    """For each RECORD-n, whether its record (absl's "I1202 ..." prefix) starts the
    text a terminal shows on its line: what follows the last carriage return."""
    starts = []
    for n in (1, 2, 3):
        (line,) = [line for line in stderr.split("\n") if f"RECORD-{n}" in line]
        shown = line.split("\r")[-1]
        starts.append(shown[0] in "IW" and shown.endswith(f"] RECORD-{n}"))
    return starts


@pytest.mark.parametrize("mode", ["safe", "raw"])
def test_records_while_a_bar_is_open_start_their_own_line(mode):
    stderr = _stderr(mode)
    starts = _records_at_line_start(stderr)
    if mode == "safe":
        assert starts == [True, True, True], stderr
        assert stderr.count("RECORD-2") == 1, stderr
    else:  # the control: without it, the first record lands after the bar's text
        assert starts[0] is False, stderr
