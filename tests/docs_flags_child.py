"""Parses documented commands' flags the way their absl apps would, without running them
(a child process of `tests/test_docs.py`).

    python docs_flags_child.py COMMANDS.json

COMMANDS.json is a list of `[kind, target, *args]`: kind "script" with the console
script's entry point "module:function", or "module" with a module run as
`python -m module`. Each command is checked in a process of its own, forked from this
one after the common imports, so no flag state leaks between checks: `absl.app.run` is
replaced by a parser, the app defines its flags as it does when run (at import, or in
its `__main__` block), `FLAGS(argv)` parses the command's argv, and the check exits 0,
or 2 with absl's message when a flag is unknown or its value does not parse (3 if the
entry point returned without reaching `app.run`). Prints a JSON list of
`{"code": exit status, "stderr": text}`, one per command.
"""

import importlib
import json
import os
import runpy
import sys
import tempfile

import jax  # noqa: F401  (imported once here, before forking, for every check)
from absl import app, flags


def _parse_instead_of_running(main, argv=None, flags_parser=None):
    del main, flags_parser
    try:
        flags.FLAGS(sys.argv if argv is None else argv)
    except flags.Error as e:
        print(f"flags do not parse: {e}", file=sys.stderr)
        os._exit(2)
    os._exit(0)


def _check(kind: str, target: str, args: list[str]) -> None:
    app.run = _parse_instead_of_running
    if kind == "script":
        module, function = target.split(":")
        sys.argv = [module.rsplit(".", 1)[-1], *args]
        getattr(importlib.import_module(module), function)()
    else:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    print(f"{target} returned without calling absl.app.run", file=sys.stderr)
    os._exit(3)


def main() -> None:
    with open(sys.argv[1]) as f:
        commands = json.load(f)
    results = []
    for kind, target, *args in commands:
        with tempfile.TemporaryFile("w+") as err:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    os.dup2(err.fileno(), 2)
                    os.dup2(err.fileno(), 1)
                    _check(kind, target, args)
                except BaseException as e:  # an import error, a bad entry point
                    print(f"{type(e).__name__}: {e}", file=sys.stderr)
                    sys.stderr.flush()
                    os._exit(4)
            _, status = os.waitpid(pid, 0)
            err.seek(0)
            results.append({"code": os.waitstatus_to_exitcode(status), "stderr": err.read()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
