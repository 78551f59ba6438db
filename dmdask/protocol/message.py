"""The one base of the messages that dmdask's scheduler and worker handlers take: a dataclass
whose fields are checked by their types, read with `typing.get_type_hints`, with the range
of a number declared with its field (`ranged`), or by a check of the field's own
(`checked`). A handler checks its request once (`Message.check`), before it changes
anything; a refused value is a `HandlerArgumentError` naming the handler, the field and
what it takes (`dmdask.arguments`). A field whose type has no check here must declare one:
the first check of its message raises TypeError otherwise, so no field goes unchecked by
omission.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import types
import typing
from typing import Any, Callable, ClassVar

from .. import arguments as check
from ..source.base import DatasetInfo

Check = Callable[[str, str, Any], Any]  # (handler, field name, value) -> anything; raises when refused
_SEQUENCES = (list, tuple, collections.abc.Sequence)
_UNIONS = (typing.Union, types.UnionType)


def checked(how: Check | None, default=dataclasses.MISSING, **kwargs):
    """A field checked by `how(handler, name, value)` rather than by its type (None: by its
    message's own `check`, which must then cover it)."""
    return dataclasses.field(default=default, metadata={"check": how}, **kwargs)


def ranged(low: float, high: float, default=dataclasses.MISSING):
    """A number field (int or float, by its type) that must lie in low..high."""
    return dataclasses.field(default=default, metadata={"low": low, "high": high})


class Message:
    """A handler's request or reply. `check` applies to requests."""

    def check(self, op: str | None = None) -> None:
        """`HandlerArgumentError`, naming `op` (default: the message's `op`) and the field,
        unless each field is of its type and in its range."""
        op = op or getattr(type(self), "op", type(self).__name__)
        for name, how in _checks(type(self)):
            how(op, name, getattr(self, name))


@functools.lru_cache(maxsize=None)
def _checks(kind: type) -> tuple:
    """(field name, check) of each field of `kind` that is checked here."""
    hints = type_hints(kind)
    out = []
    for f in dataclasses.fields(kind):
        how = f.metadata["check"] if "check" in f.metadata else check_of(hints[f.name], f.metadata, kind, f.name)
        if how is not None:
            out.append((f.name, how))
    return tuple(out)


def check_of(tp, meta: dict, kind: type = None, name: str = "") -> Check:
    """The check of a value of type `tp` (with `meta`'s low/high for a number)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNIONS and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = check_of(rest[0] if len(rest) == 1 else typing.Union[tuple(rest)], meta, kind, name)
        return lambda op, field, value: None if value is None else inner(op, field, value)
    if tp is str:
        return check.text
    if tp is bool:
        return check.flag
    if tp is int:
        return functools.partial(check.count, low=meta.get("low", 0), high=meta.get("high"))
    if tp is float:
        return functools.partial(check.number, low=meta.get("low", 0.0), high=meta.get("high", math.inf))
    if tp is bytes:
        return _bytes
    if tp is DatasetInfo:
        return lambda op, field, value: check.dataset_info(op, value)
    if isinstance(tp, type) and issubclass(tp, Message):
        return functools.partial(_message, tp)
    if origin in _SEQUENCES and args:
        if args[0] is str:
            return check.texts
        item = check_of(args[0], {}, kind, name)
        return functools.partial(_items, item)
    if origin is dict and args and args[0] is str:
        value_check = check_of(args[1], {}, kind, name)
        return functools.partial(_mapping, value_check)
    raise TypeError(f"{getattr(kind, '__name__', kind)}.{name}: no check for the type {tp}; declare one "
                    "with dmdask.protocol.message.checked(...)")


def _bytes(op: str, name: str, value) -> None:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise check.refuse(op, name, "bytes", type(value).__name__)


def _message(kind: type, op: str, name: str, value) -> None:
    if not isinstance(value, kind):
        raise check.refuse(op, name, f"a {kind.__name__}", value)
    value.check(op)


def _items(item: Check, op: str, name: str, value) -> None:
    if not isinstance(value, (list, tuple)):
        raise check.refuse(op, name, "a list", value)
    for i, v in enumerate(value):
        item(op, f"{name}[{i}]", v)


def _mapping(value_check: Check, op: str, name: str, value) -> None:
    for key, v in check.mapping(op, name, value).items():
        value_check(op, f"{name}[{key!r}]", v)


def from_dict(kind: type, value, op: str):
    """An instance of the message `kind` from the plain dict `value` (as msgpack carries it;
    nested messages too), its keys checked (`HandlerArgumentError` naming `op`), not its values
    (`check` them)."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    check.mapping(op, kind.__name__, value, known=list(fields), required=[
        n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING])
    hints = type_hints(kind)
    return kind(**{name: from_dict(hints[name], v, op) if isinstance(hints[name], type) and issubclass(hints[name], Message)
                   else v for name, v in value.items()})


@functools.lru_cache(maxsize=None)
def type_hints(kind: type) -> dict:
    return typing.get_type_hints(kind)
