"""The README and docs/ as a newcomer meets them (issue 58): every shell command in their fenced
blocks runs as written. `offloadctl` commands are parsed by the real parser (an unknown flag, a
missing argument or a placeholder like `[--json]` fails it); `make` targets exist in the
Makefile; scripts named by path exist; the pages the README and `--help` point to exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What other tools run (their own docs cover them), and shell builtins
EXTERNAL = {"ray", "curl", "export", "pip", "cd", "git", "uv", "kill", "python3", "nvidia-smi"}


def commands(page: Path) -> list[tuple[int, str]]:
    """(line, command) of every command in the page's sh/bash/shell fenced blocks: lines joined
    where they end with a backslash, comments dropped."""
    found, block, start, joined = [], None, 0, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block not in ("sh", "bash", "shell", "console"):
            continue
        text = line.strip().removeprefix("$ ")
        if not joined:
            start = number
        joined += text.removesuffix("\\") + " "
        if text.endswith("\\"):
            continue
        command = re.sub(r"(^|\s)#.*$", "", joined).strip()
        joined = ""
        if command:
            found.append((start, command))
    return found


def words(command: str) -> list[str]:
    """The command's words, without leading VAR=value assignments and a trailing `&`."""
    argv = shlex.split(command)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        argv.pop(0)
    return argv[:-1] if argv and argv[-1] == "&" else argv


ALL = [(page, line, command) for page in PAGES for line, command in commands(page)]


def test_every_page_has_commands_to_check() -> None:
    assert {p.name for p, _, _ in ALL} >= {"README.md", "serving.md", "operations.md"}


@pytest.mark.parametrize(
    ("page", "line", "command"),
    ALL,
    ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in ALL],
)
def test_a_documented_command_runs_as_written(page: Path, line: int, command: str) -> None:
    from coordinator.cli.main import build_parser

    argv = words(command)
    tool = Path(argv[0]).name if argv else ""
    if tool == "offloadctl":
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"{page.name}:{line}: `{command}` is refused by offloadctl ({exc})")
    elif tool == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert set(argv[1:]) <= set(targets), f"{page.name}:{line}: no target in {argv[1:]}"
    elif tool in ("python", ".venv/bin/python") or tool.endswith("python"):
        scripts = [a for a in argv[1:] if a.endswith(".py")]
        assert all((ROOT / s).exists() for s in scripts), f"{page.name}:{line}: {scripts}"
    else:
        assert tool in EXTERNAL, f"{page.name}:{line}: `{command}`: what runs `{tool}`?"


def test_the_links_between_pages_resolve() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to {target}"


def test_the_readme_is_short_and_help_names_the_docs() -> None:
    from coordinator.cli.main import build_parser

    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    parser = build_parser()
    named = set(re.findall(r"docs/([\w-]+\.md)", parser.format_help()))
    assert named == {p.name for p in (ROOT / "docs").glob("*.md")}, named
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        [page, errors] = re.findall(r"docs/([\w-]+\.md)", sub.format_help())
        assert (ROOT / "docs" / page).exists() and errors == "troubleshooting.md", name


def test_the_requirements_the_readme_states_are_pyprojects_and_the_pins_meet_them() -> None:
    """The README's torch and transformers floors are pyproject.toml's, and every release
    constraints/cpu.txt pins (what CI runs) is one pyproject.toml accepts."""
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {r.name: r.specifier for r in map(Requirement, project["dependencies"]) if r.specifier}
    readme = (ROOT / "README.md").read_text()
    for name in ("torch", "transformers"):
        floor = next(spec.version for spec in wanted[name] if spec.operator == ">=")
        assert f"{name} >= {floor}" in readme, (name, floor)
    pins = [
        Requirement(line.split("#")[0].strip())
        for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    checked = [pin.name for pin in pins if pin.name in wanted]
    assert {"torch", "transformers", "safetensors"} <= set(checked)
    for pin in pins:
        if pin.name in wanted:
            (version,) = [spec.version for spec in pin.specifier]
            assert wanted[pin.name].contains(version), (pin, wanted[pin.name])
