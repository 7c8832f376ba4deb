"""One copy of each page-format fact: `NULL_PAGE` and the KV cache dtypes live only in
`paxkv/pallas_kernels/layout.py`, and a second definition anywhere in the package sources fails here.

The sources are read as syntax trees (nothing is imported), so a copy is found wherever
it sits, even in a module no test imports.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The package sources, and the benchmarks run from a checkout.
SOURCE_DIRS = ("paxkv", "benchmarks")
HOME = "paxkv/pallas_kernels/layout.py"

# Names only the home may bind.
HOME_NAMES = (
    "NULL_PAGE",
    "KV_CACHE_DTYPES",
    "QUANTIZED_KV_CACHE_DTYPES",
    "QUANTIZED_PAGE_DTYPES",
    "FLOAT_PAGE_DTYPES",
    "SCALE_DTYPE",
)
# The quantized `kv_cache_dtype` names, and the page dtypes they store in (as a string or
# as an attribute: `np.int8`, `ml_dtypes.float8_e5m2`), written out by hand here on
# purpose: the test must not read the facts from the module it checks.
QUANTIZED_NAMES = frozenset({"int8", "fp8", "fp8_e5m2"})
QUANTIZED_PAGE_DTYPE_NAMES = frozenset({"int8", "float8_e4m3fn", "float8_e5m2"})


def _sources() -> dict[str, ast.Module]:
    trees = {}
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            trees[rel] = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    return trees


SOURCES = _sources()


def _bound_names(node: ast.AST) -> set[str]:
    """Names a statement binds by assignment (`x = ...`, `x: T = ...`, `a, x = ...`)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    else:
        return set()
    names = set()
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
    return names


def _literal_tokens(node: ast.AST) -> set[str] | None:
    """The strings and attribute names a collection literal spells out, one element at
    a time (`np.dtype(np.int8)` gives "int8"); None for any other node."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        elements = node.elts
    elif isinstance(node, ast.Dict):
        elements = [e for e in (*node.keys, *node.values) if e is not None]
    else:
        return None
    tokens = set()
    for element in elements:
        for sub in ast.walk(element):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                tokens.add(sub.value)
            elif isinstance(sub, ast.Attribute):
                tokens.add(sub.attr)
    return tokens


def binders(name: str, sources: dict[str, ast.Module]) -> list[str]:
    """The modules that assign `name`."""
    return [
        rel
        for rel, tree in sources.items()
        if any(name in _bound_names(node) for node in ast.walk(tree))
    ]


def dtype_lists(sources: dict[str, ast.Module]) -> list[str]:
    """The modules holding a collection literal that lists the quantized KV dtypes: every
    quantized `kv_cache_dtype` name, or two or more quantized page dtypes."""
    found = []
    for rel, tree in sources.items():
        for node in ast.walk(tree):
            tokens = _literal_tokens(node)
            if tokens is None:
                continue
            if tokens >= QUANTIZED_NAMES or len(QUANTIZED_PAGE_DTYPE_NAMES & tokens) >= 2:
                found.append(rel)
                break
    return found


@pytest.mark.parametrize("name", HOME_NAMES)
def test_each_page_format_name_is_bound_once(name):
    assert binders(name, SOURCES) == [HOME]


def test_the_quantized_dtypes_are_listed_once():
    assert dtype_lists(SOURCES) == [HOME]


@pytest.mark.parametrize(
    "copy, check",
    [
        ("NULL_PAGE: int = 0\n", lambda s: binders("NULL_PAGE", s)),
        ("KV_CACHE_DTYPES = ('auto', 'int8', 'fp8')\n", lambda s: binders("KV_CACHE_DTYPES", s)),
        ("NAMES = ['int8', 'fp8', 'fp8_e5m2']\n", dtype_lists),
        ("PAGES = (np.dtype(np.int8), ml_dtypes.float8_e5m2)\n", dtype_lists),
        ("quantized = x in ('int8', 'float8_e4m3fn')\n", dtype_lists),
    ],
)
def test_a_second_copy_is_found(copy, check):
    """The checks above fail when a copy is added to another module."""
    sources = dict(SOURCES)
    sources["paxkv/host/page_pool.py"] = ast.parse(copy)
    assert sorted(check(sources)) == sorted([HOME, "paxkv/host/page_pool.py"])
