"""FastStream's view of a bus Message: parsing, decoding, and processing a message read outside a handler."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgspec
from faststream.message import SourceType, StreamMessage, decode_message

from bus.faststream._compat import return_input
from bus.faststream.message import BusMessage, _current
from bus.types import Message

if TYPE_CHECKING:
    from collections.abc import Callable


_CORRELATION = "correlation_id"
_CONTENT_TYPE = "content-type"
_REPLY_TO = "reply_to"
_JSON = "application/json"
_JSON_STARTS = (b"{", b"[", b'"')
_json_decode = msgspec.json.Decoder().decode


async def _process_msg(
    msg: Any,
    *,
    middlewares: Iterable[Any],
    parser: Callable[[Any], Any],
    decoder: Callable[[Any], Any],
    source_type: SourceType = SourceType.CONSUME,
) -> Any:
    """FastStream's `process_msg` (a message read outside a handler: a reply, `get_one`), parsing
    the message as the middlewares' `on_receive` left it (a bus Message is frozen: a middleware
    replaces it rather than changing it in place)."""
    if msg is None:
        return None
    async with AsyncExitStack() as stack:
        return_msg: Callable[[Any], Any] = return_input
        for m in middlewares:
            await stack.enter_async_context(m)
            msg = getattr(m, "msg", msg)
            return_msg = functools.partial(m.consume_scope, return_msg)
        parsed = await parser(msg)
        parsed.source_type = source_type
        parsed.set_decoder(decoder)
        return await return_msg(parsed)


async def parse_message(msg: Message) -> BusMessage:
    """FastStream's view of a bus Message (headers carry correlation id, content type, reply_to)."""
    headers = dict(msg.headers)
    return _parsed(msg, msg.payload or b"", headers, f"{msg.topic}/{msg.partition}@{msg.offset}")


async def parse_batch(msgs: Sequence[Message]) -> BusMessage:
    """FastStream's view of a batch (FastStream's Kafka batch shape): the bodies in order, each
    message's headers in `batch_headers`, the first message's metadata for the batch."""
    batch_headers = [dict(m.headers) for m in msgs]
    first, last = msgs[0], msgs[-1]
    message_id = (
        f"{first.topic}/{first.partition}@{first.offset}..{last.topic}/{last.partition}@{last.offset}"
    )
    body = [m.payload or b"" for m in msgs]
    # A batch's raw message is the messages in order.
    return _parsed(cast("Message", msgs), body, batch_headers[0], message_id, batch_headers=batch_headers)


def _parsed(raw: Message, body: Any, headers: dict[str, str], message_id: str, **extra: Any) -> BusMessage:
    """The BusMessage of `raw`, with the settling state of the delivery under way (if any)."""
    parsed = BusMessage(
        raw_message=raw,
        body=body,
        headers=headers,
        reply_to=headers.get(_REPLY_TO, ""),
        content_type=headers.get(_CONTENT_TYPE),
        message_id=message_id,
        # A message published without one is its own correlation: its id names it as well as a
        # random one would, without drawing one per message.
        correlation_id=headers.get(_CORRELATION) or message_id,
        **extra,
    )
    current = _current.get()
    if current is not None:
        parsed.queue, parsed.verdicts, parsed.acks = current
    return parsed


def _decode_body(body: bytes, content_type: str | None) -> tuple[Any, str | None]:
    """(the decoded body, its content type): JSON by msgspec, anything else as FastStream decodes it."""
    if content_type is None and body[:1] in _JSON_STARTS:
        content_type = _JSON
    if content_type is not None and content_type.startswith(_JSON):
        try:
            return _json_decode(body), content_type
        except msgspec.DecodeError:
            pass
    return decode_message(cast("StreamMessage[Any]", _Body(body, content_type))), content_type


@dataclass(frozen=True)
class _Body:
    """What FastStream's `decode_message` reads of a message: its body and content type."""

    body: bytes
    content_type: str | None


async def decode(msg: StreamMessage[Any]) -> Any:
    """The body decoded by its content type (JSON when the bus stored a structure).

    JSON is decoded by msgspec (the bus's own codec, several times faster than the standard
    library's); a body it refuses (NaN, numbers beyond a double) goes to FastStream's decoder,
    which decides as it always does.
    """
    decoded, msg.content_type = _decode_body(msg.body, msg.content_type)
    return decoded


async def decode_batch(msg: StreamMessage[Any]) -> Any:
    """Each body of a batch decoded by its own content type, in order."""
    types = [h.get(_CONTENT_TYPE) for h in msg.batch_headers] or [msg.content_type] * len(msg.body)
    return [_decode_body(body, ct)[0] for body, ct in zip(msg.body, types, strict=True)]
