"""Command-line flags made from the config dataclasses (kiln.config), so that a setting's type,
choices, default and help live in one place: its field.

`max_num_seqs: int = field(default=64, metadata=doc("running sequences per step"))` becomes
`--max-num-seqs MAX_NUM_SEQS`, an int, with the help "running sequences per step (default: 64)".
A flag is `--` and the field's name with dashes, a trailing `_s` (seconds) dropped
(`shutdown_timeout_s` -> `--shutdown-timeout`), unless the field's `doc(flag=...)` names another.
A `bool` is a `--x / --no-x` pair, a `Literal` offers its choices, a `tuple[str, ...]` is a
repeatable flag. No flag has a default of its own: `config_from_flags` passes the dataclass only
the flags given, so the dataclass's default is the one in force. A field that is itself a config
(WorkerConfig's `engine`) is left to the command, which adds that config's flags as a group.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Collection, Mapping
from typing import Literal, TypeVar

from kiln.config_fields import field_doc, unwrap_optional

T = TypeVar("T")
FlagTarget = argparse.ArgumentParser | argparse._ArgumentGroup


def add_flags(parser: FlagTarget, cls: type, *, skip: Collection[str] = (),
              required: Collection[str] = (), computed: Mapping[str, str] | None = None) -> None:
    """A flag for each field of `cls` but those in `skip`, nested configs and `doc(cli=False)`
    fields. Flags in `required` must be given; `computed` says, for a field whose default the
    command computes instead (`{"worker_id": "HOST-PID"}`), what that default is."""
    computed = computed or {}
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls, skip):
        parser.add_argument(flag_name(f), dest=flag_dest(f), default=None,
                            required=f.name in required, help=_help(f, computed.get(f.name)),
                            **_value_spec(cls, f, hints[f.name]))


def flags_given(args: argparse.Namespace, cls: type) -> dict[str, object]:
    """The fields of `cls` whose flags were given, by field name (a flag `add_flags` did not
    add reads as not given)."""
    given = {}
    for f in flag_fields(cls):
        value = getattr(args, flag_dest(f), None)
        if value is not None:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return given


def config_from_flags(args: argparse.Namespace, cls: type[T], **nested: object) -> T:
    """`cls` from the flags given, its defaults elsewhere; `nested` supplies the fields that
    have no flag (the nested configs)."""
    return cls(**flags_given(args, cls), **nested)


def flag_fields(cls: type, skip: Collection[str] = ()) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags: not skipped, not `doc(cli=False)`, not configs."""
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls)
            if f.name not in skip and field_doc(f).cli
            and not dataclasses.is_dataclass(unwrap_optional(hints[f.name])[0])]


def flag_name(f: dataclasses.Field) -> str:
    return field_doc(f).flag or "--" + f.name.removesuffix("_s").replace("_", "-")


def flag_dest(f: dataclasses.Field) -> str:
    return flag_name(f).removeprefix("--").replace("-", "_")


def _value_spec(cls: type, f: dataclasses.Field, annotation: object) -> dict[str, object]:
    """add_argument's type, choices or action for a field's annotation."""
    base, _ = unwrap_optional(annotation)
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        return {"choices": choices, "type": type(choices[0])}
    if typing.get_origin(base) is tuple and typing.get_args(base)[1:] == (Ellipsis,):
        return {"action": "append", "type": typing.get_args(base)[0]}
    if base in (int, float, str):
        return {"type": base}
    raise TypeError(f"{cls.__name__}.{f.name}: no flag for a field of type {annotation}")


def _help(f: dataclasses.Field, computed_default: str | None) -> str:
    shown = computed_default or _shown_default(f)
    text = f"{field_doc(f).help} (default: {shown})" if shown else field_doc(f).help
    return text.replace("%", "%%")  # argparse %-formats help


def _shown_default(f: dataclasses.Field) -> str | None:
    """The default as a user reads it (a None default as its `none_means`); None where there is
    nothing to show."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None:
        return field_doc(f).none_means
    return None if default in ("", ()) else str(default)
