"""Command-line flags generated from config dataclasses (``ray_ddp.config.fields``): a
field's name gives the flag (``batch_size`` -> ``--batch-size``), its annotation the
type, its docstring the help text, its section's title the help group, and its
``option`` facts the rest. Imports neither Ray nor torch."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

from ray_ddp.config.fields import config_fields, field_docs, flag_name, flag_of, sections_of

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
    names = {f.name for f in config_fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})
