"""Launch apps over the library: `paxkv-generate`, `paxkv-serve`, `paxkv-plan`, ...

`flags.py` holds the flags the apps share and builds library objects from them; each
app's `main()` parses its flags, builds, and runs. Here, so that they import without
defining any flag (or importing JAX): `run_app`, how every app starts, and
`exit_with_error`, how it ends on bad input; `define_seed`, every app's `--seed`;
`list_in_help`, what every app's `--help` lists; `read_prompts`, which reads the
prompt files of `paxkv-generate`; and `json_object`, how a flag or a line of JSON is read.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from absl import app
from absl.flags import (  # not `flags`: that name is the submodule `paxkv.launch.flags`
    FLAGS,
    DEFINE_integer,
    Error,
    FlagHolder,
)

from paxkv.host.request import MAX_SEED

JSON_SHOWN_CHARS = 120  # of a value `json_object` refuses, shown in its error


def exit_with_error(message: str, status: int = 2) -> NoReturn:
    """Ends an app: the message as one line on stderr, no traceback, exit `status` (2: bad
    input; 1: an answer of "no", such as `paxkv-plan`'s "does not fit")."""
    line = " ".join(message.split())  # a multi-line message still prints as one line
    print(f"error: {line}", file=sys.stderr)
    sys.exit(status)


def run_app(main: Callable[[list[str]], None]) -> None:
    """`absl.app.run(main)`, where a flag absl refuses (`--num_pages=abc`, a value out of
    its bounds or choices, an unknown flag) ends the app as any bad input does: one
    `error:` line, exit 2 (absl's own parser prints a FATAL block and exits 1)."""
    app.run(main, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except Error as e:
        exit_with_error(str(e))


def define_seed(default: int, help_text: str) -> FlagHolder[int]:
    """An app's `--seed`, bounded by what it seeds (`MAX_SEED`: an int64 for JAX)."""
    return DEFINE_integer("seed", default, help_text, lower_bound=0, upper_bound=MAX_SEED)


def list_in_help(app_module: str, doc: str | None, *shared_modules: str) -> None:
    """Makes `--help` show the app's doc and the flags of `app_module` and of
    `shared_modules` (for the serving apps, `paxkv.launch.flags`).

    absl's `--help` shows the flags of the module named by `sys.argv[0]`, which for a
    console script is the installed wrapper, where no flag is defined.
    """
    main = sys.modules["__main__"]
    for module in (app_module, *shared_modules):
        for flag in FLAGS.get_flags_for_module(module):
            FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    if not main.__doc__:
        main.__doc__ = doc


def read_prompts(path: str | os.PathLike) -> list[str | dict]:
    """The prompts of a file: one per line, as text or as JSON objects.

    A `.jsonl` file, or any file whose first non-blank line is a JSON object, holds one
    object per line with "prompt" (a string) or "prompt_token_ids" (a list of ints).
    Any other file holds one text prompt per line. Blank lines are skipped. Raises
    ValueError, naming the file and line, for a malformed line or a file with no prompts.
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        lines = [(i, line.rstrip("\r\n")) for i, line in enumerate(f, 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: the file holds no prompts")
    if not (path.endswith(".jsonl") or _is_json_object(lines[0][1])):
        return [line for _, line in lines]
    return [_json_prompt(path, i, line) for i, line in lines]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def json_object(text: str, where: str) -> dict:
    """`text` parsed as a JSON object. ValueError otherwise, naming `where` (a flag such
    as `--speculative_config`, or a file and line) and showing the value."""
    shown = text if len(text) <= JSON_SHOWN_CHARS else text[:JSON_SHOWN_CHARS] + "..."
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}): {shown!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}: {shown!r}")
    return value


def _json_prompt(path: str, lineno: int, line: str) -> dict:
    where = f"{path}:{lineno}"
    record = json_object(line, where)
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of ints")
        return {"prompt_token_ids": ids}
    if isinstance(record.get("prompt"), str):
        return {"prompt": record["prompt"]}
    raise ValueError(
        f'{where}: expected {{"prompt": str}} or {{"prompt_token_ids": [int, ...]}}, '
        f"got keys {sorted(record)}"
    )
