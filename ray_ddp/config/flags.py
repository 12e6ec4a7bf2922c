"""Command-line flags generated from config dataclasses (``ray_ddp.config.fields``): a
field's name gives the flag (``batch_size`` -> ``--batch-size``), its annotation the
type, its docstring the help text, its section's title the help group, and its
``option`` facts the rest.

``--help`` is a page a person can scan: a line or two per flag, its docstring's first
sentence and its default. ``--help-all`` prints every docstring whole. Imports neither Ray
nor torch."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ray_ddp.config.fields import (
    Flag,
    config_fields,
    field_docs,
    field_value,
    flag_name,
    flag_of,
    sections_of,
)

T = TypeVar("T")


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

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
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
    if isinstance(value, float):
        return f"{value:g}"  # 60, not 60.0
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _text(doc: str) -> str:
    """A docstring as one line of plain text."""
    return " ".join(doc.replace("``", "").split())


def first_sentence(doc: str) -> str:
    """What ``--help`` shows of a field's docstring: its first sentence, without the full
    stop (``e.g.``, ``i.e.`` and ``2.60`` end none)."""
    text = " ".join(doc.split())
    first = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z0-9(`])", text, maxsplit=1)[0]
    return _text(first).rstrip(".")


@dataclass(frozen=True)
class FieldText:
    """What :class:`FieldHelp` and docs/flags.md read of a field's flag, kept on its
    argparse action (``field_text``)."""

    full_help: str
    """The whole docstring, laid out for ``--help-all``."""
    doc: str
    """The docstring as written."""
    facts: Flag
    auto: bool
    """The docstring says ``Auto:``: a ``None`` default decides by itself."""
    fixed_default: str | None
    """The default shown whatever the parser's default (``unchanged``, or ``Flag.shown``)."""


def field_text(action: argparse.Action) -> FieldText | None:
    """A field's flag's :class:`FieldText`; None for other flags (``--help-all``)."""
    text = vars(action).get("field_text")
    return text if isinstance(text, FieldText) else None


def default_text(action: argparse.Action) -> str | None:
    """The default ``--help`` shows for a field's flag, read when the help is printed (so
    an own loop's ``set_defaults`` shows): ``on``/``off`` for switches, ``auto`` where the
    field decides by itself (None, and its docstring says ``Auto:``), else the value."""
    text = field_text(action)
    if text is not None and text.fixed_default:
        return text.fixed_default
    default = action.default
    if isinstance(action, _Toggle) and default is None:
        return "auto"
    if isinstance(default, bool):  # a switch: what it turns on or off, without it
        return "on" if default else "off"
    if default is None:
        return "auto" if text is not None and text.auto else None
    return _shown(default)


class FieldHelp(argparse.HelpFormatter):
    """``--help``: a line or two per flag, its docstring's first sentence and its default,
    grouped by section; switches shown as ``--[no-]x``."""

    full = False  # FullHelp: every docstring whole

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=24 if self.full else 28)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        field = field_text(action)
        if field is None or action.help is None:
            return action.help  # not a field's flag: its help as written
        text = field.full_help if self.full else action.help
        default = default_text(action)
        if default is not None:
            text += f" (default: {default})"
        return text.replace("%", "%%")  # argparse formats help with %

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _Toggle) and not self.full:
            on, off = action.option_strings
            if off == "--no-" + on.removeprefix("--"):
                return "--[no-]" + on.removeprefix("--")
        return super()._format_action_invocation(action)


class FullHelp(FieldHelp):
    """``--help-all``: every flag with its whole docstring, as docs/flags.md has it."""

    full = True


class _HelpAll(argparse.Action):
    """``--help-all``: print the full help and exit, as ``--help`` does the short one."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.formatter_class, parser.usage = FullHelp, None  # the usage of every flag
        parser.print_help()
        parser.exit()


def field_parser(
    prog: str, description: str, usage: str = "%(prog)s [options]"
) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` is short (:class:`FieldHelp`) and whose
    ``--help-all`` explains every flag in full."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        usage=usage,
        formatter_class=FieldHelp,
        epilog="Every flag explained: --help-all, or docs/flags.md.",
    )
    parser.add_argument(
        "--help-all", action=_HelpAll, help="show every flag's full explanation and exit"
    )
    return parser


def _metavar(facts: Flag, kind: Any) -> str | None:
    """The value's placeholder: the field's own, its choices, or ``N`` (int), ``X``
    (float); None: argparse's (the field name in capitals)."""
    if facts.metavar or facts.choices:
        return facts.metavar or "{" + ",".join(facts.choices) + "}"
    return {int: "N", float: "X", list[int]: "N,N,..."}.get(kind)


def _annotate(action: argparse.Action, facts: Flag, doc: str, overrides: str | None) -> None:
    """What :class:`FieldHelp` reads of a field's flag: the short and the full help."""
    action.help = first_sentence(doc) or None
    fixed = "unchanged" if overrides else facts.shown
    vars(action)["field_text"] = FieldText(_text(doc), doc, facts, "Auto:" in doc, fixed)


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
    hints = {}
    for _, section in sections_of(cls):
        hints.update(typing.get_type_hints(section))
    docs, titles = (
        field_docs(cls),
        {f.name: title for title, section in sections_of(cls) for f in dataclasses.fields(section)},
    )
    defaults = cls()
    groups: dict[str, Any] = {}
    for f in config_fields(cls):
        facts = flag_of(f)
        if not facts.cli or (sweep and not facts.sweep) or (only and f.name not in only):
            continue
        title = overrides or titles[f.name]
        if title not in groups:
            groups[title] = parser.add_argument_group(title) if title else parser
        group = groups[title]
        kind, optional = _field_type(hints[f.name])
        default = None if overrides else field_value(defaults, f.name)
        flag, negative = flag_name(f.name), facts.negative or "--no-" + f.name.replace("_", "-")

        if kind is bool and (optional or overrides):
            action = group.add_argument(flag, negative, dest=f.name, action=_Toggle, default=None)
        elif kind is bool and default:
            action = group.add_argument(negative, dest=f.name, action="store_false")
        elif kind is bool:
            action = group.add_argument(flag, dest=f.name, action="store_true")
        else:
            parse = facts.parse or (int_list if kind == list[int] else kind)
            metavar = _metavar(facts, kind)
            action = group.add_argument(
                flag, dest=f.name, type=parse, default=default, metavar=metavar
            )
        _annotate(action, facts, (help_text or {}).get(f.name) or docs.get(f.name, ""), overrides)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The ``cls`` instance the parsed flags describe; fields without a flag keep their
    defaults."""
    names = {f.name for f in config_fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


# --------------------------------------------------------------------- docs/flags.md
REGENERATE = "python jobs/flags_doc.py"


def _markdown(text: str) -> str:
    """A docstring's text for markdown: ````code```` as ```code```, and ``<`` outside code
    spans escaped (``list<float>`` is no HTML tag)."""
    parts = " ".join(text.split()).split("``")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _flag_entry(action: argparse.Action, swept: bool) -> list[str]:
    """One flag of docs/flags.md: its heading, its facts in a line, its whole docstring."""
    text = field_text(action)
    assert text is not None, "a field's flag"
    facts = text.facts
    names = " / ".join(f"`{option}`" for option in action.option_strings)
    if action.nargs != 0 and not facts.choices:
        names = names[:-1] + f" {action.metavar or action.dest.upper()}`"
    default = default_text(action)
    shown = [f"Default: {default}" if default else "Default: not set"]
    if facts.choices:
        shown.append("one of " + ", ".join(f"`{c}`" for c in facts.choices))
    if facts.resume_safe:
        shown.append("a re-run of its `--name` may change it")
    if swept and not facts.sweep:
        shown.append("not in jobs/tune.py")
    return [f"#### {names}", "", "; ".join(shown) + ".", "", _markdown(text.doc), ""]


def _sections_markdown(cls: type, swept: bool) -> list[str]:
    """Each section of ``cls`` with a flag: its title, its docstring, its flags."""
    parser = argparse.ArgumentParser()
    add_fields(parser, cls)
    about = {title: inspect.getdoc(section) or "" for title, section in sections_of(cls)}
    for attribute, section in getattr(cls, "SECTIONS", {}).items():  # a TrainConfig's
        about[section.TITLE] += f" In code: ``cfg.{attribute}.<field>``."
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if field_text(a) is not None]
        if actions:
            title = group.title or ""
            lines += [f"### {title}", "", _markdown(about.get(title, "")), ""]
            lines += [line for a in actions for line in _flag_entry(a, swept)]
    return lines


def flags_markdown() -> str:
    """docs/flags.md: every flag of ``jobs/train.py`` and ``jobs/tune.py``, by section, with
    its default, choices and whole docstring (what ``--help-all`` prints)."""
    from ray_ddp.config.sweep import SweepConfig
    from ray_ddp.config.train import TrainConfig

    lines = [
        "# Flags",
        "",
        "Every flag of `jobs/train.py` (and of an own loop's script, `ray_ddp.main`) and of",
        "`jobs/tune.py` (and of an own loop's sweep, `ray_ddp.sweep`), by section: its",
        "default, its choices, whether a re-run of a named run may change it, and its whole",
        "explanation. `--help` shows each flag's first sentence; `--help-all` all of it.",
        "",
        "Generated from the config fields (`ray_ddp/config/sections.py`, `sweep.py`) by",
        f"`{REGENERATE}`; tests/test_docs.py fails when it differs from them. Edit the",
        "fields, not this file.",
        "",
        "## jobs/train.py",
        "",
        *_sections_markdown(TrainConfig, swept=True),
        "## jobs/tune.py",
        "",
        "A sweep takes the flags above (but those marked not in jobs/tune.py), with",
        "`--batch-size` the reference batch of `--scale-lr`, and these:",
        "",
        *_sections_markdown(SweepConfig, swept=False),
        "## jobs/evaluate.py",
        "",
        "A checkpoint, `--split`, `--predictions` and `--summary-json`, and changes to some",
        "of the flags above: `python jobs/evaluate.py --help`.",
    ]
    return "\n".join(lines) + "\n"
