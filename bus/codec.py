"""Payload and header encoding, with errors that say what to pass instead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import msgspec

from bus.types import Message
from storage.errors import ValidationError
from storage.names import utf8_text

_encoder = msgspec.json.Encoder()
_headers_decoder = msgspec.json.Decoder(dict[str, str])


def encode_payload(payload: object, *, allow_tombstone: bool, limit: int) -> bytes | None:
    """bytes stay bytes; anything msgspec can encode becomes JSON; None is a tombstone where allowed."""
    kind = type(payload)
    if kind is bytes:
        data = cast("bytes", payload)
    elif kind is dict:  # the usual structured payload, checked and encoded without detours
        if not _PLAIN.issuperset(map(type, cast("dict[object, object]", payload).values())):
            _refuse_sets(payload)
        data = encode_json(payload)
    elif payload is None:
        if allow_tombstone:
            return None
        raise ValidationError(
            "payload None is a tombstone and only allowed on cleanup='compact' topics; "
            "publish bytes or a JSON-encodable value"
        )
    elif isinstance(payload, bytes):
        data = payload
    elif isinstance(payload, (bytearray, memoryview)):
        data = bytes(payload)
    else:
        _refuse_sets(payload)
        data = encode_json(payload)
    if len(data) > limit:
        raise ValidationError(
            f"message of {len(data)} bytes is larger than max_message_bytes={limit}; "
            "split it, store it elsewhere and publish a reference, or raise the topic's limit"
        )
    return data


def encode_json(payload: object) -> bytes:
    """`payload` as JSON; ValidationError (saying what to pass) when it cannot be encoded."""
    try:
        return _encoder.encode(payload)
    except (TypeError, msgspec.EncodeError, OverflowError, UnicodeEncodeError) as exc:
        raise ValidationError(
            f"payload of type {type(payload).__name__} cannot be encoded as JSON ({exc}); "
            "pass bytes, a msgspec.Struct, or dict/list/str/number values"
        ) from exc


def _refuse_sets(payload: object) -> None:
    if _holds_a_set(payload):
        raise ValidationError(
            "payload contains a set, which has no JSON form (msgspec would write an array in arbitrary "
            "order and value() would not give a set back); pass bytes, a msgspec.Struct, or "
            "dict/list/str/number values (a sorted list instead of the set)"
        )


_PLAIN: frozenset[type] = frozenset({str, int, float, bool, type(None)})
#: The value types of a flat dict payload that need no check before encoding (publish's fast path).
PLAIN_VALUES = _PLAIN


def _holds_a_set(value: object) -> bool:
    """True when a set hides in `value` or its plain containers (Structs declare their own field types).

    Iterative and dispatching on exact types: it runs on every structured payload, so the usual
    flat container of scalars costs one C-level pass over its values' types.
    """
    kind = type(value)
    if kind is set or kind is frozenset:
        return True
    items: Any
    if kind is dict:
        items = cast("dict[object, object]", value).values()
    elif kind is list or kind is tuple:
        items = value
    else:
        return False
    if _PLAIN.issuperset(map(type, items)):
        return False
    stack: list[object] = [item for item in items if type(item) not in _PLAIN]
    while stack:
        item = stack.pop()
        if type(item) in _PLAIN:
            continue
        if isinstance(item, (set, frozenset)):
            return True
        if isinstance(item, dict):
            stack.extend(cast("dict[object, object]", item).values())
        elif isinstance(item, (list, tuple)):
            stack.extend(cast("list[object]", item))
    return False


def encode_headers(headers: object) -> str | None:
    """Headers as JSON text; ValidationError for anything but a dict of str to str PostgreSQL can store.

    The common case costs one type check per entry and one encode: the text checks
    (no NUL, no lone surrogate) run on the encoded form and name the culprit only on failure.
    """
    if headers is None:
        return None
    if not isinstance(headers, dict):
        raise ValidationError("headers must be a dict of str to str")
    for k, v in cast("dict[object, object]", headers).items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise ValidationError("headers must be a dict of str to str")
    try:
        text = _encoder.encode(headers).decode()
    except UnicodeEncodeError:
        text = None
    if text is None or "\\u0000" in text:  # a surrogate, or maybe a NUL (JSON escapes it so)
        for k, v in cast("dict[str, str]", headers).items():
            utf8_text(k, "header names")
            utf8_text(v, "header values")
        if text is None:  # pragma: no cover - utf8_text raised for the surrogate
            raise ValidationError("headers are not valid Unicode text; pass proper str values")
    return text


def decode_headers(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    return _headers_decoder.decode(text)


def validate_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str):
        raise ValidationError(f"key must be a str or None, not {type(key).__name__}")
    if key.isascii() and "\x00" not in key:  # the common case, without encoding
        return key
    return utf8_text(key, "key")


def messages_from_rows(topic: str, partition: str, rows: Sequence[Any], attempt: int = 1) -> list[Message]:
    """Messages from fetched log rows ("offset", key, headers, payload, created_at), in order.

    The consumer's hot path: rows are unpacked positionally and an absent
    header object costs nothing to decode.
    """
    out: list[Message] = []
    append = out.append
    for offset, key, headers, payload, created_at in rows:
        append(
            Message(
                topic=topic,
                partition=partition,
                offset=offset,
                key=key,
                headers=_headers_decoder.decode(headers) if headers else {},
                payload=payload,
                created_at=created_at,
                attempt=attempt,
            )
        )
    return out


def to_message(topic: str, partition: str, row: Any, attempt: int = 1) -> Message:
    """One Message from a fetched log row (columns "offset", key, headers, payload, created_at)."""
    return Message(
        topic=topic,
        partition=partition,
        offset=row["offset"],
        key=row["key"],
        headers=decode_headers(row["headers"]),
        payload=row["payload"],
        created_at=row["created_at"],
        attempt=attempt,
    )
