"""README.md stays a newcomer's page (at most 8 KiB) whose commands work: every elastic-run, examples/train.py and
examples/scenario.py command in its fenced code blocks parses with the program's own parser, nothing run. The
command lines of docs/*.md are parsed too (flags only: they may elide parts with `...`), and every relative link
in README.md and docs/*.md names a file and heading that exist."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from example_modules import load_example

from launcher.commands import log as log_command
from launcher.commands import purge as purge_command
from launcher.commands.cli import ConfigError, build_parser, config_from_args

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
README_LIMIT = 8192
# written by bench/run_all: the benchmarks' printed output, whose elastic-run lines are descriptions, not commands
GENERATED_DOCS = {"benchmarks.md"}
DOCS = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in GENERATED_DOCS)
SHELL_FENCES = {"bash", "sh", "shell", "console"}  # a bare ``` holds output or a listing
SEPARATORS = {"&&", "||", ";", "|"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    source: str  # file:line, for the test id and the failure message
    env: dict[str, str]
    argv: list[str]  # argv[0] is the program: elastic-run, examples/train.py or examples/scenario.py

    def __str__(self) -> str:
        return f"{self.source}: {shlex.join(self.argv)}"


def shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, logical line) of each shell fenced block, `\\` continuations joined and `$ ` prompts dropped."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None  # the open block's info string
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            continue
        if fence not in SHELL_FENCES:
            continue
        start, text = pending if pending else (number, "")
        text += " " + stripped.removeprefix("$ ")
        if text.endswith("\\"):
            pending = (start, text[:-1])
            continue
        pending = None
        lines.append((start, text.strip()))
    return lines


def commands_in(path: Path) -> list[Command]:
    """The commands of the programs this test knows, one per `&&`/`;`/`|` segment, env assignments split off."""
    found = []
    for number, line in shell_lines(path):
        words = shlex.split(line, comments=True)
        segments: list[list[str]] = [[]]
        for word in words:
            if word in SEPARATORS:
                segments.append([])
            else:
                segments[-1].append(word)
        for segment in segments:
            env = {}
            while segment and ENV_ASSIGNMENT.match(segment[0]):
                name, _, value = segment.pop(0).partition("=")
                env[name] = value
            if segment[:1] and segment[0] in ("python", "python3"):
                segment = segment[1:]
            if not segment:
                continue
            program = segment[0].removeprefix("./")
            if program == "elastic-run" or program in ("examples/train.py", "examples/scenario.py"):
                found.append(Command(f"{path.relative_to(REPO)}:{number}", env, [program, *segment[1:]]))
    return found


def scenario_parser() -> argparse.ArgumentParser:
    """examples/scenario.py builds its parser inside main(), next to the code that runs etcd and agents: rebuild
    it here from its add_argument calls (their literal arguments, and int/float/str types)."""
    tree = ast.parse((REPO / "examples" / "scenario.py").read_text())
    parser = argparse.ArgumentParser(prog="examples/scenario.py")
    types = {"int": int, "float": float, "str": str}
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
    ]
    assert calls, "examples/scenario.py adds its arguments with parser.add_argument"
    for call in calls:
        kwargs = {}
        for keyword in call.keywords:
            if keyword.arg == "type" and isinstance(keyword.value, ast.Name) and keyword.value.id in types:
                kwargs["type"] = types[keyword.value.id]
            elif keyword.arg in ("choices", "default", "nargs", "action"):
                kwargs[keyword.arg] = ast.literal_eval(keyword.value)
        parser.add_argument(*(ast.literal_eval(arg) for arg in call.args), **kwargs)
    return parser


def refusal(capsys) -> str:
    """The last line a parser printed before its SystemExit: `prog: error: ...`."""
    return (capsys.readouterr().err.strip().splitlines() or ["(nothing printed)"])[-1]


def parse(parser: argparse.ArgumentParser, args: list[str], command: Command, capsys) -> argparse.Namespace:
    try:
        return parser.parse_args(args)
    except SystemExit:
        error = refusal(capsys)
    pytest.fail(f"{command} does not parse: {error}", pytrace=False)


def check(command: Command, monkeypatch, capsys, tmp_path: Path, *, whole: bool) -> None:
    """Parse `command` as its program would. `whole`: also build elastic-run's LaunchConfig (every value checked,
    the script found) and refuse `...`; docs' command lines may elide parts, so they get their flags parsed."""
    if whole:
        assert "..." not in command.argv, f"{command}: a README command must be complete, not elided with ..."
    for name, value in command.env.items():
        monkeypatch.setenv(name, value)  # before the parser is built: PET_* are its defaults
    program, args = command.argv[0], command.argv[1:]
    if program == "examples/scenario.py":
        parse(scenario_parser(), args, command, capsys)
        return
    if program == "examples/train.py":
        parse_train(args, command, capsys)
        return
    if args[:1] == ["log"]:
        parse(log_command.build_parser(), args[1:], command, capsys)
        return
    if args[:1] == ["purge"]:
        parse(purge_command.build_parser(), args[1:], command, capsys)
        return
    parsed = parse(build_parser(), args, command, capsys)
    script = parsed.training_script
    if whole:
        if "/" in script or parsed.module or parsed.no_python:
            monkeypatch.chdir(REPO)  # the README's commands run from the repository root
        else:  # the reader's own script (train.py): a placeholder stands in for it
            (tmp_path / script).touch()
            monkeypatch.chdir(tmp_path)
        try:
            config_from_args(parsed)
        except ConfigError as exc:
            pytest.fail(f"{command} is refused: {exc}", pytrace=False)
    if not parsed.module and not parsed.no_python and Path(script).name == "train.py":
        # examples/train.py, or a bare train.py that stands for a script like it: its flags are train.py's
        parse_train(parsed.training_script_args, command, capsys)


def parse_train(args: list[str], command: Command, capsys) -> None:
    try:
        load_example("train").parse_config(args)
        return
    except SystemExit:
        error = refusal(capsys)
    pytest.fail(f"{command}: examples/train.py refuses {shlex.join(args)}: {error}", pytrace=False)


README_COMMANDS = commands_in(README)
DOCS_COMMANDS = [command for path in DOCS for command in commands_in(path)]


def test_the_readme_is_at_most_8_kib():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move the detail to docs/"


def test_the_readme_commands_are_found():
    """The extraction sees what the README promises, so an empty list cannot pass the checks below."""
    lines = [shlex.join(c.argv) for c in README_COMMANDS]
    assert any(line.startswith("elastic-run --standalone") and "examples/train.py" in line for line in lines), lines
    assert any(line.startswith("elastic-run log ") for line in lines), lines
    assert {"kill-node", "grow"} <= {c.argv[1] for c in README_COMMANDS if c.argv[0] == "examples/scenario.py"}


@pytest.mark.parametrize("command", README_COMMANDS, ids=lambda c: c.source)
def test_every_readme_command_parses(command: Command, monkeypatch, capsys, tmp_path):
    check(command, monkeypatch, capsys, tmp_path, whole=True)


@pytest.mark.parametrize("command", DOCS_COMMANDS, ids=lambda c: c.source)
def test_every_docs_command_parses(command: Command, monkeypatch, capsys, tmp_path):
    check(command, monkeypatch, capsys, tmp_path, whole=False)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"#{1,6} (.*)", line)):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


@pytest.mark.parametrize("page", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        file = (page.parent / file_part).resolve() if file_part else page
        if not file.exists():
            broken.append(f"{target}: no file {file_part}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
