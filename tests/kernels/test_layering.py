"""The kernels package sits at the bottom of the dependency order: it never imports paxkv."""

import ast
import pathlib

import pytest

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "paxkv" / "pallas_kernels"


def _imported_modules(path: pathlib.Path) -> list[str]:
    """Absolute modules a file imports, with `import`, `from` or `importlib.import_module`."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.append(node.args[0].value)
    return names


@pytest.mark.parametrize(
    "path", sorted(KERNELS.rglob("*.py")), ids=lambda p: str(p.relative_to(KERNELS))
)
def test_kernels_never_import_paxkv(path):
    upward = [m for m in _imported_modules(path) if m == "paxkv" or m.startswith("paxkv.")]
    assert not upward, f"{path.name} imports {upward}: pallas_kernels imports only itself"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import importlib\nimportlib.import_module('paxkv.engine')\n")
    assert _imported_modules(bad) == ["importlib", "paxkv.engine"]
