"""How a config field documents itself and checks its choices (a leaf: kiln.config and
kiln.config_cli read it). `doc(...)` is a field's metadata; `check_choices` enforces `Literal`
annotations."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class FieldDoc:
    """A config field's documentation: `help` for its flag and readers; `none_means`, for a
    field whose default is None, what happens then; `flag` where the flag is not the field's
    own name (kiln.config_cli.flag_name); `cli=False` for a field that no command line sets
    (the command sets it, or another flag names it)."""

    help: str
    none_means: str | None = None
    flag: str | None = None
    cli: bool = True


def doc(help: str, *, none_means: str | None = None, flag: str | None = None,
        cli: bool = True) -> dict[str, FieldDoc]:
    """A field's `metadata`: `field(default=16, metadata=doc("tokens per KV block"))`."""
    return {"doc": FieldDoc(help, none_means, flag, cli)}


def field_doc(f: dataclasses.Field) -> FieldDoc:
    return f.metadata.get("doc") or FieldDoc("")


def check_choices(config: object) -> None:
    """ValueError naming the first field whose value is not one of its `Literal` choices."""
    for name, choices in literal_fields(type(config)).items():
        value = getattr(config, name)
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, "
                             f"got {value!r}")


@functools.cache
def literal_fields(cls: type) -> dict[str, tuple]:
    """Each field of `cls` annotated `Literal[...]` (or `Literal[...] | None`) -> its choices
    (None among them where the annotation allows it)."""
    hints = typing.get_type_hints(cls)
    choices = {}
    for f in dataclasses.fields(cls):
        base, optional = unwrap_optional(hints[f.name])
        if typing.get_origin(base) is Literal:
            choices[f.name] = (*typing.get_args(base), *((None,) if optional else ()))
    return choices


def unwrap_optional(annotation: object) -> tuple[object, bool]:
    """`X | None` -> (X, True); anything else -> (itself, False)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False
