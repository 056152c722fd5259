"""Validation of every name that reaches PostgreSQL.

Values always travel as parameters; the only identifier ever interpolated
into a statement is the schema name, and only after `validate_schema`.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Literal, overload

from storage.errors import ValidationError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_SCHEMA = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_PARTITION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@=-]{0,199}")


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_name(value: object, what: str = "name") -> str:
    """A topic, group, store or worker name: 1-200 of [A-Za-z0-9._-], starting with a letter or digit."""
    if not isinstance(value, str) or _NAME.fullmatch(value) is None or ".." in value:
        raise ValidationError(
            f"invalid {what} {_describe(value)}: use 1 to 200 ASCII letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no spaces, ';', '..' or control characters)"
        )
    return value


def validate_partition(value: object) -> str:
    """A partition name: like a topic name, with ':', '@' and '=' also allowed (e.g. 'customer:42')."""
    if not isinstance(value, str) or _PARTITION.fullmatch(value) is None or ".." in value:
        raise ValidationError(
            f"invalid partition name {_describe(value)}: use 1 to 200 ASCII letters, digits or '._:@=-', "
            "starting with a letter or digit"
        )
    return value


def validate_worker_id(value: object) -> str:
    """A worker id: like a partition name (e.g. 'host-1:pid-42'), 1-200 of [A-Za-z0-9._:@=-]."""
    if not isinstance(value, str) or _PARTITION.fullmatch(value) is None:
        raise ValidationError(
            f"invalid worker id {_describe(value)}: use 1 to 200 ASCII letters, digits or '._:@=-', "
            "starting with a letter or digit (e.g. 'host-1:pid-42')"
        )
    return value


def validate_schema(value: object) -> str:
    """A plain PostgreSQL identifier: a letter or '_', then letters, digits or '_', at most 63 characters."""
    if not isinstance(value, str) or _SCHEMA.fullmatch(value) is None:
        raise ValidationError(
            f"invalid schema {_describe(value)}: use a letter or '_' followed by letters, digits or '_' "
            "(at most 63 characters)"
        )
    return value


#: Offsets are PostgreSQL bigints.
MAX_OFFSET = 2**63 - 1
#: The longest duration (seconds, about 31 years) any timeout, lease or retention may have;
#: also keeps NaN and infinity out (they fail the comparison).
MAX_SECONDS = 1e9


def validate_offset(value: object, what: str = "offset") -> int:
    """An offset: an integer from 0 to 2**63 - 1."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OFFSET:
        raise ValidationError(f"invalid {what} {_describe(value)}: use an integer >= 0 (at most 2**63 - 1)")
    return value


def validate_int(value: object, what: str, lo: int, hi: int | None = None) -> int:
    """An int (not a bool) from `lo` to `hi` (no upper bound when `hi` is None)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise ValidationError(f"{what} must be an integer {bound}, got {_describe(value)}")
    return value


@overload
def validate_seconds(
    value: timedelta | float,
    what: str,
    *,
    allow_zero: bool = ...,
    allow_none: Literal[False] = ...,
) -> float: ...
@overload
def validate_seconds(
    value: timedelta | float | None,
    what: str,
    *,
    allow_zero: bool = ...,
    allow_none: Literal[True],
) -> float | None: ...
def validate_seconds(
    value: object,
    what: str,
    *,
    allow_zero: bool = False,
    allow_none: bool = False,
) -> float | None:
    """A duration in seconds from a timedelta or a number (an int or float, not a bool).

    Refuses NaN, infinity, negatives, more than MAX_SECONDS, and 0 unless `allow_zero`;
    None passes through as None only with `allow_none`.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        accepted = "a timedelta or a number of seconds" + (", or None" if allow_none else "")
        raise ValidationError(f"{what} must be {accepted}, got {_describe(value)}")
    if (
        not math.isfinite(seconds)
        or not (0 <= seconds if allow_zero else 0 < seconds)
        or seconds > MAX_SECONDS
    ):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValidationError(
            f"{what} must be a number of seconds {bound} (at most {MAX_SECONDS:.0e}), got {_describe(value)}"
        )
    return seconds


def utf8_text(value: str, what: str) -> str:
    """`value` unchanged if PostgreSQL can store it: no NUL, no lone surrogate."""
    if "\x00" in value:
        raise ValidationError(f"{what} may not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(
            f"{what} is not valid Unicode text (it holds a lone surrogate); pass proper str values"
        ) from None
    return value
