"""The documentation cannot drift from the code (no Ray started): every ``python jobs/...``
command line in README.md and docs/ parses with the job's real argument parser, every
relative link points at a file that exists, the README stays a front door (300 lines at
most), and docs/architecture.md, the one module map, names every module of the package."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from ray_ddp.driver.cli import evaluate_parser, train_parser, tune_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARSERS = {"train": train_parser, "tune": tune_parser, "evaluate": evaluate_parser}
COMMAND = re.compile(r"python3? (?:\S*/)?jobs/(train|tune|evaluate)\.py\b(.*)")
SHELL_ENDS = {"&&", "||", "|", ";", ">", "2>&1"}


def _documents() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    names = sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))
    return [os.path.join(ROOT, "README.md"), *names]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _command_lines(text: str) -> list[str]:
    """Shell lines of fenced code blocks (continuations joined) and inline code spans."""
    lines, fenced = [], re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    for block in fenced:
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    lines += re.findall(r"`([^`\n]+)`", prose)
    return lines


def _commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in _documents():
        for line in _command_lines(_read(path)):
            match = COMMAND.search(line)
            if match is None:
                continue
            tokens = []
            for token in shlex.split(match.group(2), comments=True):
                if token in SHELL_ENDS:
                    break
                tokens.append(token)
            found.append((os.path.relpath(path, ROOT), match.group(1), tokens))
    return found


COMMANDS = _commands()


def test_the_docs_show_commands_of_every_job():
    assert {job for _, job, _ in COMMANDS} == set(PARSERS)
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize(
    "where, job, args", COMMANDS, ids=[f"{w}:{j}:{' '.join(a)[:40]}" for w, j, a in COMMANDS]
)
def test_every_documented_command_line_parses(where, job, args):
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            PARSERS[job]().parse_args(args)
        except SystemExit as stop:
            assert stop.code == 0, f"{where}: jobs/{job}.py {' '.join(args)}\n{errors.getvalue()}"


def test_relative_links_point_at_files_that_exist():
    broken = []
    for path in _documents():
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(path)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
            if not os.path.exists(file):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_is_a_front_door():
    lines = _read(os.path.join(ROOT, "README.md")).count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move the detail to docs/"


def _sections(text: str) -> dict[str, str]:
    """Each heading of a markdown text and the text under it, to the next heading."""
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_the_architecture_doc_maps_every_module():
    """The one module map: a section per folder of ray_ddp (its path in the heading) that
    names each of the folder's modules."""
    sections = _sections(_read(os.path.join(ROOT, "docs", "architecture.md")))
    missing = []
    for folder, _, names in os.walk(os.path.join(ROOT, "ray_ddp")):
        if "__pycache__" in folder:
            continue
        package = os.path.relpath(folder, ROOT).replace(os.sep, "/") + "/"
        heading = re.compile(rf"`{re.escape(package)}`")
        body = "".join(text for title, text in sections.items() if heading.search(title))
        if not body:
            missing.append(package)
            continue
        modules = [n for n in sorted(names) if n.endswith(".py") and n != "__init__.py"]
        for name in modules:
            if not re.search(rf"(?<![\w/.]){re.escape(name)}", body):
                missing.append(package + name)
    assert not missing, missing
