"""The documentation cannot drift from the code (no Ray started): every ``python jobs/...``
command line in README.md and docs/ parses with the job's real argument parser, every
relative link points at a file that exists, the README stays a front door (300 lines at
most), docs/architecture.md, the one module map, names every module of the package, and
every ``--flag`` the docs and ray_ddp's docstrings name is a flag of a job or script."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex

import pytest

from ray_ddp.config.flags import REGENERATE, flags_markdown
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


# Flags of other tools that the docs and docstrings show, by tool; and the placeholders
# that explanations use. Every other ``--flag`` named must be one of ours.
OTHER_TOOLS = {
    "ray": {"--autoscaling-config", "--gcs-address", "--working-dir", "--follow", "--generate",
            "--reason", "--deadline-remaining-seconds"},
    "mlflow server": {"--host", "--port", "--backend-store-uri", "--artifacts-destination"},
    "py-spy": {"--native", "--pid"},
    "tensorboard": {"--logdir"},
    "ruff": {"--check"},
    "placeholders": {"--flag", "--no-x"},
}  # fmt: skip
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9](?![\w<-])")


def _script_flags() -> set[str]:
    """The flags the project's own scripts define (benchmarks/, examples/): their
    ``add_argument("--x", ...)`` calls, read from the source."""
    found = set()
    for top in ("benchmarks", "examples"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in (n for n in names if n.endswith(".py")):
                tree = ast.parse(_read(os.path.join(folder, name)))
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == (
                        "add_argument"
                    ):
                        found |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return {flag for flag in found if isinstance(flag, str) and flag.startswith("--")}


def _named_flags() -> dict[str, list[str]]:
    """Each ``--flag`` named in ray_ddp's source (docstrings, comments, messages),
    README.md and docs/*.md, with where."""
    paths = _documents()
    for folder, _, names in os.walk(os.path.join(ROOT, "ray_ddp")):
        paths += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    named: dict[str, list[str]] = {}
    for path in paths:
        for number, line in enumerate(_read(path).splitlines(), 1):
            for flag in FLAG.findall(line):
                named.setdefault(flag, []).append(f"{os.path.relpath(path, ROOT)}:{number}")
    return named


def test_every_flag_the_docs_and_docstrings_name_exists():
    """A renamed or removed flag leaves no explanation behind that still tells people to
    use it (``--sample-ledger`` did, for a testing aid that is now ray_ddp.testing's)."""
    ours = {s for parser in PARSERS.values() for a in parser()._actions for s in a.option_strings}
    known = ours | _script_flags() | set().union(*OTHER_TOOLS.values())
    named = _named_flags()
    assert len(named) > 50 and "--num-workers" in named  # it reads what it should
    stale = {flag: where[:3] for flag, where in named.items() if flag not in known}
    assert not stale, f"flags that no job or script has: {stale}"


def test_the_flags_reference_is_what_the_fields_say():
    """docs/flags.md is generated from the config fields; a field changed without
    regenerating it fails here, saying how to."""
    text = _read(os.path.join(ROOT, "docs", "flags.md"))
    assert text == flags_markdown(), f"docs/flags.md is out of date: run {REGENERATE}"
    headings = " ".join(re.findall(r"^#### (.*)$", text, flags=re.M))
    jobs_own = {"-h", "--help", "--help-all"}
    for job in ("train", "tune"):
        for action in PARSERS[job]()._actions:
            for option in set(action.option_strings) - jobs_own:
                assert f"`{option}" in headings, (job, option)
    assert "#### `--use-gpu` / `--no-gpu`" in text and "one of `ddp`, `fsdp2`" in text
