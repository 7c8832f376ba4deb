"""Import paths that moved keep working for a release: the old path is the new module,
with a DeprecationWarning (docs/moved.md)."""

import subprocess
import sys

import pytest

from paxkv import MOVED

_CHECK = """
import importlib, sys, warnings
old, new = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = importlib.import_module(old)
assert module is importlib.import_module(new), (module, new)
assert module.__spec__.name == new, module.__spec__.name
moved = [w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
assert moved and new in str(moved[0].message), [str(w.message) for w in caught]
"""


def test_every_moved_path_is_the_new_module_with_a_warning():
    # One interpreter per path would take a minute: all in one, each before its new path
    # is imported by another (the old name is what is checked, so order does not matter).
    script = "\n".join(
        ["import sys"]
        + [
            f"sys.argv = ['', {old!r}, {new!r}]; exec(compile({_CHECK!r}, 'check', 'exec'))"
            for old, new in MOVED.items()
        ]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_old_setup_names_warn_and_answer():
    from paxkv.launch import setups

    with pytest.warns(DeprecationWarning, match="get_setup"):
        get_config = setups.get_config
    assert get_config("tiny") is setups.get_setup("tiny")
    with pytest.warns(DeprecationWarning, match="SETUPS"):
        assert setups.CONFIGS is setups.SETUPS


def test_an_unknown_path_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        __import__("paxkv.tools.no_such_module")
