"""The README and docs/ are executed: every fenced Python and shell block runs here on
the CPU with the tiny models, or has its flags checked, or says why it cannot.

Marking (an HTML comment on the line right before the fence):
- `<!-- docs-test: skip (reason) -->`: the block is not run; the reason is required.
- `<!-- docs-test: flags-only -->` (shell): every `paxkv-*` console script and every
  `python -m paxkv.X` in it has its flags parsed by its absl app (not run); other
  commands in it (pip, curl, gcloud, pytest) are not run.
An unmarked Python block runs: a page's Python blocks are concatenated in order, as in a
notebook, and run in a fresh interpreter. An unmarked shell command must be a `paxkv-*`
console script or `python -m paxkv.X` (flags checked, then run for real: keep them cheap)
or one of `SAFE_COMMANDS`; anything else fails the test and asks the author to mark it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
FLAGS_CHILD = Path(__file__).resolve().parent / "docs_flags_child.py"
PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# Commands an unmarked shell block may hold besides paxkv's own: they change nothing.
SAFE_COMMANDS = {"echo", "uptime", "nproc"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<mode>[\w-]+)\s*(?:\((?P<reason>[^)]*)\))?\s*-->$")
README_MAX_LINES = 250
PYTHON_TIMEOUT_S = 900
COMMAND_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its page, first line (1-based), language, marking and text."""

    page: Path
    line: int
    lang: str
    mode: str  # "run", "skip" or "flags-only"
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Command:
    """One simple command of a shell line: `script` (a console script), `module`
    (`python -m paxkv.X`) or `other`."""

    kind: str
    target: str  # the script's entry point "module:function", the module, or the program
    args: tuple[str, ...]


def extract_blocks(page: Path, text: str | None = None) -> list[Block]:
    """The Python and shell blocks of a markdown page, with their markings.

    Raises ValueError for a malformed marking (unknown mode, skip without a reason,
    flags-only on a Python block) or an unclosed fence.
    """
    lines = (page.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: unclosed code fence")
        i += 1
        mode = "run"
        marker = MARKER.match(lines[start - 1].strip()) if start > 0 else None
        if marker:
            mode, reason = marker.group("mode"), (marker.group("reason") or "").strip()
            if mode not in ("skip", "flags-only"):
                raise ValueError(f"{page}:{start}: unknown docs-test marking {mode!r}")
            if mode == "skip" and not reason:
                raise ValueError(f"{page}:{start}: `docs-test: skip` needs a (reason)")
            if mode == "flags-only" and lang not in SHELL_LANGS:
                raise ValueError(f"{page}:{start}: flags-only applies to shell blocks only")
        elif start > 0 and "docs-test" in lines[start - 1]:
            raise ValueError(f"{page}:{start}: malformed docs-test marking {lines[start - 1]!r}")
        if lang in PYTHON_LANGS | SHELL_LANGS:
            blocks.append(Block(page, start + 1, lang, mode, "\n".join(body) + "\n"))
    return blocks


def command_lines(code: str) -> list[str]:
    """The logical command lines of a shell block: continuations joined, `$ ` prompts
    and comment-only lines dropped."""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        line = line.removeprefix("$ ")
        if line and not line.startswith("#"):
            out.append(line)
    return out


def parse_commands(line: str) -> list[Command]:
    """The simple commands of one shell line (split at `&&`, `||`, `;`, `|`), each
    classified; a `--command=...` argument (gcloud ssh) is parsed as a line too."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[Command] = []
    words: list[str] = []
    for token in [*lexer, ";"]:
        if token and set(token) <= set(";&|"):
            if words:
                commands.extend(_classify(words))
            words = []
        else:
            words.append(token)
    return commands


def _classify(words: list[str]) -> list[Command]:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]  # VAR=value prefixes
    if not words:
        return []
    program, args = words[0], tuple(words[1:])
    nested = [c for a in args if a.startswith("--command=") for c in parse_commands(a[10:])]
    if program in SCRIPTS:
        return [Command("script", SCRIPTS[program], args), *nested]
    modules = ("paxkv", "benchmarks.")
    if program in PYTHONS and len(args) >= 2 and args[0] == "-m" and args[1].startswith(modules):
        return [Command("module", args[1], args[2:]), *nested]
    return [Command("other", program, args), *nested]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # `python -m benchmarks.NAME` runs from a checkout: its root on the path.
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def check_flags(commands: list[tuple[Command, str]]) -> None:
    """Fails unless every command's module exists and its absl app parses its argv
    (`(command, where it is documented)` pairs, checked in one child process)."""
    for command, where in commands:
        module = command.target.split(":")[0]
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"{where}: `{module}` does not exist (a renamed module?)")
    if not commands:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[c.kind, c.target, *c.args] for c, _ in commands], f)
    try:
        result = subprocess.run(
            [sys.executable, str(FLAGS_CHILD), f.name],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=COMMAND_TIMEOUT_S + 10 * len(commands),
        )
    finally:
        os.unlink(f.name)
    assert result.returncode == 0, f"the flags checker failed:\n{result.stderr[-3000:]}"
    checks = json.loads(result.stdout.strip().splitlines()[-1])
    failures = [
        f"{where}: flags of `{c.target} {' '.join(c.args)}` do not parse "
        f"(exit {check['code']}):\n{check['stderr'][-1500:]}"
        for (c, where), check in zip(commands, checks, strict=True)
        if check["code"] != 0
    ]
    if failures:
        pytest.fail("\n".join(failures))


def paxkv_commands(block: Block) -> list[tuple[Command, str]]:
    """The paxkv commands of a shell block, with where they are documented. Fails for a
    command of an unmarked block that is neither paxkv's nor known to be safe."""
    out = []
    for line in command_lines(block.code):
        for command in parse_commands(line):
            if command.kind in ("script", "module"):
                out.append((command, block.where))
            elif block.mode == "run" and command.target not in SAFE_COMMANDS:
                pytest.fail(
                    f"{block.where}: `{command.target}` in an unmarked shell block: it is "
                    "neither a paxkv command nor known to be safe to run here. Put "
                    "`<!-- docs-test: flags-only -->` (paxkv flags checked, nothing run) or "
                    "`<!-- docs-test: skip (reason) -->` on the line before the fence."
                )
    return out


def run_block(block: Block, workdir: Path) -> None:
    """Runs every command line of an unmarked shell block; fails on a non-zero exit."""
    for line in command_lines(block.code):
        result = subprocess.run(
            ["bash", "-c", line],
            capture_output=True,
            text=True,
            cwd=workdir,
            env=_env(),
            timeout=COMMAND_TIMEOUT_S,
        )
        if result.returncode != 0:
            pytest.fail(
                f"{block.where}: `{line}` exited {result.returncode}:\n"
                f"{result.stdout[-1500:]}\n{result.stderr[-2500:]}"
            )


def check_shell_blocks(blocks: list[Block], workdir: Path) -> None:
    """Checks the flags of every paxkv command of the blocks, then runs the unmarked ones."""
    blocks = [b for b in blocks if b.lang in SHELL_LANGS and b.mode != "skip"]
    check_flags([c for b in blocks for c in paxkv_commands(b)])
    for block in blocks:
        if block.mode == "run":
            run_block(block, workdir)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    """The page's unmarked Python blocks, in order, in one fresh interpreter, exit 0."""
    blocks = [b for b in extract_blocks(page) if b.lang in PYTHON_LANGS and b.mode == "run"]
    if not blocks:
        return
    script = tmp_path / "page.py"
    script.write_text("".join(f"# --- {b.where}\n{b.code}" for b in blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
        timeout=PYTHON_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{page_id(page)}: its Python blocks (concatenated in {script}) exited "
        f"{result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_shell_blocks(page: Path, tmp_path: Path) -> None:
    """Every shell block's paxkv commands exist and parse; unmarked ones run."""
    check_shell_blocks(extract_blocks(page), tmp_path)


def test_readme_is_short_and_links_resolve() -> None:
    readme = ROOT / "README.md"
    num_lines = len(readme.read_text().splitlines())
    assert num_lines <= README_MAX_LINES, f"README.md has {num_lines} lines"
    assert (ROOT / "docs").is_dir()
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # absolute URLs and anchors within the page
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page_id(page)} links to {target}, which does not exist"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


# The checker itself, on synthetic pages: it must be able to fail.

SYNTHETIC = Path(ROOT / "synthetic.md")


def _blocks(text: str) -> list[Block]:
    return extract_blocks(SYNTHETIC, text)


def test_markings_are_read() -> None:
    text = (
        "```python\nx = 1\n```\n"
        "<!-- docs-test: skip (needs a TPU) -->\n```bash\ngcloud x\n```\n"
        "<!-- docs-test: flags-only -->\n```sh\npaxkv-plan \\\n  --device=H200\n```\n"
    )
    blocks = _blocks(text)
    assert [(b.lang, b.mode, b.line) for b in blocks] == [
        ("python", "run", 1),
        ("bash", "skip", 5),
        ("sh", "flags-only", 9),
    ]
    assert command_lines(blocks[2].code) == ["paxkv-plan    --device=H200"]


@pytest.mark.parametrize(
    "text",
    [
        "<!-- docs-test: skip -->\n```bash\ncurl x\n```\n",
        "<!-- docs-test: skip () -->\n```bash\ncurl x\n```\n",
        "<!-- docs-test: maybe -->\n```bash\ncurl x\n```\n",
        "<!-- docs-test: flags-only -->\n```python\nx = 1\n```\n",
        "```bash\npaxkv-demo\n",
    ],
)
def test_malformed_markings_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        _blocks(text)


def test_commands_are_classified() -> None:
    line = (
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
        "JAX_PLATFORMS=cpu paxkv-bench --num_requests=4"
    )
    assert [c.kind for c in parse_commands(line)] == ["other", "other", "other", "script"]
    bench = parse_commands(line)[-1]
    assert bench == Command("script", SCRIPTS["paxkv-bench"], ("--num_requests=4",))
    module = parse_commands("python -m benchmarks.kv_write --x=1 | tee out")
    assert module[0] == Command("module", "benchmarks.kv_write", ("--x=1",))
    nested = parse_commands('gcloud tpu-vm ssh v --command="paxkv-generate --mesh=model:16"')
    assert [c.kind for c in nested] == ["other", "script"]
    assert nested[1].args == ("--mesh=model:16",)


def test_unmarked_unknown_command_fails(tmp_path: Path) -> None:
    (block,) = _blocks("```bash\npip install -e .\n```\n")
    with pytest.raises(pytest.fail.Exception, match="docs-test: flags-only"):
        check_shell_blocks([block], tmp_path)


def test_bad_flag_and_missing_module_fail(tmp_path: Path) -> None:
    (block,) = _blocks(
        "<!-- docs-test: flags-only -->\n```bash\npaxkv-plan --no_such_flag=1\n```\n"
    )
    with pytest.raises(pytest.fail.Exception, match="no_such_flag"):
        check_shell_blocks([block], tmp_path)
    (block,) = _blocks("<!-- docs-test: flags-only -->\n```bash\npaxkv-plan --page_size=x\n```\n")
    with pytest.raises(pytest.fail.Exception, match="page_size"):
        check_shell_blocks([block], tmp_path)
    (block,) = _blocks("<!-- docs-test: flags-only -->\n```bash\npython -m paxkv.nowhere\n```\n")
    with pytest.raises(pytest.fail.Exception, match="does not exist"):
        check_shell_blocks([block], tmp_path)
