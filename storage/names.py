"""Validation of every name that reaches PostgreSQL.

Values always travel as parameters; the only identifier ever interpolated
into a statement is the schema name, and only after `validate_schema`.
"""

from __future__ import annotations

import re

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
