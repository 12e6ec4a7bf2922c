"""What a config field knows about itself: each setting is defined once.

A config field is its own flag. Its name gives the flag (``batch_size`` -> ``--batch-size``),
its annotation the type, its attribute docstring the help text (the first sentence in
``--help``, all of it in ``--help-all`` and docs/flags.md), and the ``TITLE`` of its section
(a dataclass of ``ray_ddp.config.sections``) the help group. The few facts a field cannot
state by itself go in its ``dataclasses.field(metadata=...)``, written with
:func:`option`: the allowed values, a bound, a custom off switch, whether a re-run of a
named run may change it, whether a sweep offers it, whether it has a flag at all.
Validation messages, the re-run guard and the parsers all read these, so a new field needs
no second edit.

Imports neither Ray nor torch: ``config`` imports this module, and workers import config.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
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
    """The value's placeholder in ``--help`` (default: ``N`` for an int, ``X`` for a float,
    else the field name in capitals)."""
    shown: str | None = None
    """How ``--help`` names the default, where its value is too long to show."""
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


def flag_of(f: dataclasses.Field[Any]) -> Flag:
    flag = f.metadata.get("flag")
    return flag if isinstance(flag, Flag) else Flag()


def flag_name(name: str) -> str:
    """The flag of a field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def resume_safe_fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in config_fields(cls) if flag_of(f).resume_safe)


# --------------------------------------------------------------------- values and checks
def value_problem(f: dataclasses.Field[Any], value: Any) -> str | None:
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
    for f in config_fields(obj):
        if wanted is None or f.name in wanted:
            problem = value_problem(f, field_value(obj, f.name))
            if problem:
                return problem
    return None


def field_value(obj: Any, name: str) -> Any:
    """Field ``name`` of a config: by its section in a ``TrainConfig`` (``cfg.value``), as
    an attribute of a section or a ``SweepConfig``."""
    value = getattr(type(obj), "value", None)
    return obj.value(name) if callable(value) else getattr(obj, name)


# --------------------------------------------------------------------- documentation
def sections_of(cls: type) -> list[tuple[str, type]]:
    """``(help group title, dataclass)`` of a config class: its sections (``SECTIONS``: a
    ``TrainConfig``), or the class itself (its ``TITLE``)."""
    sections = getattr(cls, "SECTIONS", None)
    if sections:
        return [(section.TITLE, section) for section in sections.values()]
    return [(getattr(cls, "TITLE", ""), cls)]


def config_fields(cls_or_obj: Any) -> list[dataclasses.Field[Any]]:
    """Every field of a config class (or instance), its sections' in order."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    return [f for _, section in sections_of(cls) for f in dataclasses.fields(section)]


@functools.cache
def _docs_of(cls: type) -> dict[str, str]:
    """Attribute docstrings of dataclass ``cls`` (the string right under each field), from
    its source: Python keeps no attribute docstrings at run time."""
    import ast
    import inspect
    import textwrap

    definition = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(definition, ast.ClassDef), cls
    body = definition.body
    docs = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring, by field name (over a config's sections)."""
    return {name: doc for _, section in sections_of(cls) for name, doc in _docs_of(section).items()}
