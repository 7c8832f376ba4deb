"""Parses one documented command's flags the way its absl app would, and exits without
running it (a child process of `tests/test_docs.py`, so no flag state leaks between checks).

    python docs_flags_child.py script paxkv.launch.plan:run --config=llama-3.1-8b ...
    python docs_flags_child.py module paxkv.benchmarks.kv_write --flag=...

`absl.app.run` is replaced by a parser: the app defines its flags as it does when run
(at import, or in its `__main__` block), then `FLAGS(argv)` parses the command's argv
and the process exits 0, or 2 with absl's message when a flag is unknown or its value
does not parse. Exit 3 if the entry point returned without reaching `app.run`.
"""

import importlib
import runpy
import sys

from absl import app, flags


def _parse_instead_of_running(main, argv=None, flags_parser=None):  # noqa: ARG001
    try:
        flags.FLAGS(sys.argv if argv is None else argv)
    except flags.Error as e:
        print(f"flags do not parse: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0)


def check() -> None:
    kind, target, *args = sys.argv[1:]
    app.run = _parse_instead_of_running
    if kind == "script":
        module, function = target.split(":")
        sys.argv = [module.rsplit(".", 1)[-1], *args]
        getattr(importlib.import_module(module), function)()
    elif kind == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    print(f"{target} returned without calling absl.app.run", file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    check()
