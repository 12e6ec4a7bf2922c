"""Command-line flags generated from config dataclasses: each setting is defined once.

A config field is its own flag. Its name gives the flag (``batch_size`` -> ``--batch-size``),
its annotation the type, its attribute docstring the help text, and the section comment
above it (``# --- data ---``) the help group. The few facts a field cannot state by itself
go in its ``dataclasses.field(metadata=...)``, written with :func:`option`: the allowed
values, a bound, a custom off switch, whether a re-run of a named run may change it,
whether a sweep offers it, whether it has a flag at all. Validation messages, the
re-run guard and the parsers all read these, so a new field needs no second edit.

Imports neither Ray nor torch: ``config`` imports this module, and workers import config.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Bound:
    """A limit on a number, and the words a refusal uses: ``--flag <text>, got <value>``."""

    text: str
    ok: Callable[[Any], bool]


POSITIVE = Bound("must be positive", lambda v: v > 0)
NON_NEGATIVE = Bound("must be zero or more", lambda v: v >= 0)


@dataclass(frozen=True)
class Flag:
    """What a field's definition cannot say by itself. The defaults fit most fields."""

    choices: tuple[str, ...] = ()
    """Allowed values, checked by validation (one actionable line, not argparse's usage)."""
    bound: Bound | None = None
    """A limit checked by validation; ``None`` values (auto) are not checked."""
    negative: str | None = None
    """The off switch of a bool, if not ``--no-<name>``."""
    parse: Callable[[str], Any] | None = None
    """Turns the flag's text into the value, if the annotation's type does not."""
    metavar: str | None = None
    """The value's placeholder in ``--help`` (default: the field name in capitals)."""
    resume_safe: bool = False
    """A re-run of a named run may change it (how the run is executed, logged or extended,
    not what is trained); see ``rerun_guard``."""
    sweep: bool = True
    """``jobs/tune.py`` offers it too."""
    cli: bool = True
    """It has a flag; ``False`` for values the code sets (internal fields, testing aids)."""


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **flag: Any) -> Any:
    """A dataclass field with :class:`Flag` facts: ``x: int = option(3, bound=POSITIVE)``."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={"flag": Flag(**flag)}
    )


def flag_of(f: dataclasses.Field) -> Flag:
    return f.metadata.get("flag", Flag())


def flag_name(name: str) -> str:
    """The flag of a field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def resume_safe_fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if flag_of(f).resume_safe)


# --------------------------------------------------------------------- values and checks
def value_problem(f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with ``value`` for field ``f`` by its own stated limits, as one line."""
    facts = flag_of(f)
    if value is None:
        return None
    if facts.choices and value not in facts.choices:
        return f"unknown {flag_name(f.name)} {value!r}; choose one of: {', '.join(facts.choices)}"
    if facts.bound is not None and not facts.bound.ok(value):
        return f"{flag_name(f.name)} {facts.bound.text}, got {value}"
    return None


def first_problem(obj: Any, names: Iterable[str] | None = None) -> str | None:
    """The first field of dataclass instance ``obj`` (of ``names``, default all) whose value
    breaks its stated choices or bound."""
    wanted = None if names is None else set(names)
    for f in dataclasses.fields(obj):
        if wanted is None or f.name in wanted:
            problem = value_problem(f, getattr(obj, f.name))
            if problem:
                return problem
    return None


# --------------------------------------------------------------------- documentation
@functools.cache
def _read_class(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """Attribute docstrings and section titles of ``cls``, from its source."""
    import ast
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(cls))
    sections = [
        (number, match.group(1))
        for number, line in enumerate(source.splitlines(), start=1)
        if (match := re.match(r"\s*# --- (.+?) ---\s*$", line))
    ]
    body = ast.parse(source).body[0].body
    docs, groups = {}, {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[name] = inspect.cleandoc(str(after.value.value))
        above = [title for number, title in sections if number < node.lineno]
        groups[name] = above[-1] if above else ""
    return docs, groups


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string right under it), by field name."""
    return _read_class(cls)[0]


def field_groups(cls: type) -> dict[str, str]:
    """Each field's section title (the last ``# --- title ---`` comment above it)."""
    return _read_class(cls)[1]


# --------------------------------------------------------------------- parsers
def int_list(text: str) -> list[int]:
    """``32,64,128`` -> ``[32, 64, 128]``."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 32,64,128, got {text!r}"
        ) from None


class _Toggle(argparse.Action):
    """``--x`` / ``--no-x`` for a field where ``None`` means "decide automatically"; the
    two conflict, as in a mutually exclusive group."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        on, off = self.option_strings
        value = option_string == on
        if getattr(namespace, self.dest) not in (None, value):
            parser.error(
                f"argument {option_string}: not allowed with argument {off if value else on}"
            )
        setattr(namespace, self.dest, value)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _field_type(hint: Any) -> tuple[Any, bool]:
    """``int | None`` -> ``(int, True)``; ``float`` -> ``(float, False)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _help(doc: str, default: str | None) -> str:
    text = " ".join(doc.replace("``", "").split())
    if default is not None:
        text += f" (default: {default})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_fields(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    sweep: bool = False,
    only: Sequence[str] | None = None,
    overrides: str | None = None,
    help_text: dict[str, str] | None = None,
) -> None:
    """Add a flag for every field of dataclass ``cls`` that has one, in help groups by
    section. ``sweep``: only the fields a sweep offers. ``only``: just these fields.
    ``overrides``: every flag defaults to None (not given) and they share one group with
    this title, for changing some values of a config saved elsewhere. ``help_text``:
    replaces the help of some fields."""
    hints = typing.get_type_hints(cls)
    docs, sections = field_docs(cls), field_groups(cls)
    defaults = cls()
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        facts = flag_of(f)
        if not facts.cli or (sweep and not facts.sweep) or (only and f.name not in only):
            continue
        title = overrides or sections[f.name]
        if title not in groups:
            groups[title] = parser.add_argument_group(title) if title else parser
        group = groups[title]
        kind, optional = _field_type(hints[f.name])
        default = None if overrides else getattr(defaults, f.name)
        doc = (help_text or {}).get(f.name) or docs.get(f.name, "")
        flag, negative = flag_name(f.name), facts.negative or "--no-" + f.name.replace("_", "-")

        if kind is bool and (optional or overrides):
            shown = "unchanged" if overrides else None
            group.add_argument(
                flag, negative, dest=f.name, action=_Toggle, default=None, help=_help(doc, shown)
            )
        elif kind is bool and default:
            group.add_argument(negative, dest=f.name, action="store_false", help=_help(doc, "on"))
        elif kind is bool:
            group.add_argument(flag, dest=f.name, action="store_true", help=_help(doc, "off"))
        else:
            parse = facts.parse or (int_list if kind == list[int] else kind)
            metavar = facts.metavar or (
                "{" + ",".join(facts.choices) + "}" if facts.choices else None
            )
            shown = "unchanged" if overrides else (None if default is None else _shown(default))
            group.add_argument(
                flag,
                dest=f.name,
                type=parse,
                default=default,
                metavar=metavar,
                help=_help(doc, shown),
            )


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The ``cls`` instance the parsed flags describe; fields without a flag keep their
    defaults."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})
