"""OpenTelemetry tracing (the `otel` extra), following the messaging semantic conventions.

* `publish` / `publish_many` open a PRODUCER span ("publish <topic>") and put
  its W3C trace context (`traceparent`, `tracestate`) into each message's headers.
* A subscription's handler runs inside a CONSUMER span ("process <topic>")
  whose parent is the publisher's context (so a handler that publishes
  continues the trace), with a link to it as well.
* Batch reads (`poll`, claims, queue takes, event-store claims) record one
  CONSUMER span ("receive <topic>" / "claim ..." / "take ...") linked to the
  publishers of the messages they return, with the batch size.

Without OpenTelemetry installed every function here returns at once: no
import, no allocation on the hot paths.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.trace import Link, TracerProvider
    from opentelemetry.util.types import AttributeValue

    from bus.types import Message


def _installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):  # not installed, or blocked in sys.modules
        return False


#: True when OpenTelemetry's API is installed (the `otel` extra); it is imported on first use
#: (each function imports it after checking ENABLED: after the first time, a dict lookup).
ENABLED = _installed()
_provider: TracerProvider | None = None  # None: OpenTelemetry's global tracer provider
_seen_sdk = False  # a real global tracer provider was seen (it cannot be unset)
_UNKNOWN = object()
# A provider named in the environment (OpenTelemetry reads it when the global provider is first asked for).
_ENV_PROVIDER = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
SYSTEM = "pgactorbus"
_MAX_LINKS = 128  # a batch links at most this many publishers
_TRACE_HEADERS = ("traceparent", "tracestate")
Attributes = dict[str, "AttributeValue"]


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Trace through `provider` instead of OpenTelemetry's global one (None: back to the global one)."""
    global _provider
    _provider = provider


class _Api:
    """OpenTelemetry's `trace` and `context` modules, imported once (the hot paths ask per call)."""

    def __init__(self) -> None:
        from opentelemetry import context, trace

        self.context = context
        self.trace = trace


_api_modules: _Api | None = None


def _api() -> _Api:
    global _api_modules
    if _api_modules is None:
        _api_modules = _Api()
    return _api_modules


def _recording() -> bool:
    """True when spans would be recorded: a tracer provider was given or an SDK installed globally.

    Without one, OpenTelemetry's API records nothing, so the hot paths skip it (a microsecond
    instead of tens); `publishing` and `processing` still go through the API when there is a
    parent context to pass on, as the API does without an SDK.
    """
    global _seen_sdk
    if _seen_sdk or _provider is not None:
        return True
    trace = _api().trace
    # Without a global provider set (and none named in the environment), nothing records: skip the
    # public lookup, which reads the environment on every call.
    if getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is None and not _ENV_PROVIDER:
        return False
    provider = trace.get_tracer_provider()
    # A global provider is set once and for all: once a real one is seen, it stays.
    _seen_sdk = not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
    return _seen_sdk


def wanted() -> bool:
    """True when a publish should open its PRODUCER span: something records, or a parent context is to go on."""
    return ENABLED and (_recording() or _has_parent())


def processing_wanted(message: Message) -> bool:
    """True when a handler should run inside a CONSUMER span (something records, or a context is to go on)."""
    return ENABLED and (_recording() or "traceparent" in message.headers or _has_parent())


def _has_parent() -> bool:
    """True when the current context holds a valid span (the common empty context is checked first)."""
    api = _api()
    if not api.context.get_current():
        return False
    trace = api.trace
    return bool(trace.get_current_span().get_span_context().is_valid)


def message_id(topic: str, partition: str, offset: int) -> str:
    """`messaging.message.id`: a message's place in the log."""
    return f"{topic}/{partition}/{offset}"


@contextmanager
def publishing(topic: str, count: int) -> Iterator[dict[str, str] | None]:
    """A PRODUCER span around a publish; yields the trace headers to add to each message (None: no tracing)."""
    if not wanted():
        yield None
        return
    from opentelemetry import propagate, trace

    attributes: Attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": topic,
    }
    if count != 1:
        attributes["messaging.batch.message_count"] = count
    tracer = trace.get_tracer("pgactorbus", tracer_provider=_provider)
    with tracer.start_as_current_span(
        f"publish {topic}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ) as span:
        carrier: dict[str, str] = {}
        if span.get_span_context().is_valid:
            propagate.inject(carrier)
        yield carrier or None


def with_trace_headers(
    headers: dict[str, str] | None, trace: Mapping[str, str] | None
) -> dict[str, str] | None:
    """The message's headers with the publisher's trace context added (the caller's own keys win).

    Anything but a dict of headers is returned untouched, for publish's validation to refuse.
    """
    if not trace or not (headers is None or isinstance(headers, dict)):
        return headers
    merged = dict(trace)
    if headers:
        merged.update(headers)
    return merged


def _link(headers: Mapping[str, str]) -> Link | None:
    from opentelemetry import propagate, trace

    if "traceparent" not in headers:
        return None
    ctx = propagate.extract({k: headers[k] for k in _TRACE_HEADERS if k in headers})
    span_context = trace.get_current_span(ctx).get_span_context()
    return trace.Link(span_context) if span_context.is_valid else None


def _links(messages: Sequence[Message]) -> list[Link]:
    links = []
    for m in messages:
        link = _link(m.headers)
        if link is not None:
            links.append(link)
            if len(links) >= _MAX_LINKS:
                break
    return links


def received(operation: str, messages: Sequence[Message], *, group: str | None = None) -> None:
    """Record one CONSUMER span for a batch handed to the user (poll, claim, take), linked to its publishers."""
    if not ENABLED or not messages or not _recording():
        return
    from opentelemetry import trace

    first = messages[0]
    attributes: Attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "receive",
        "messaging.operation.name": operation,
        "messaging.destination.name": first.topic,
        "messaging.destination.partition.id": first.partition,
        "messaging.batch.message_count": len(messages),
    }
    if group is not None:
        attributes["messaging.consumer.group.name"] = group
    if len(messages) == 1:
        attributes["messaging.message.id"] = message_id(first.topic, first.partition, first.offset)
    tracer = trace.get_tracer("pgactorbus", tracer_provider=_provider)
    span = tracer.start_span(
        f"{operation} {first.topic}",
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=_links(messages),
    )
    span.end()


def claimed_events(store: str, group: str, partition_key: str, count: int) -> None:
    """Record one CONSUMER span for an event-store claim (events carry no publisher context to link)."""
    if not ENABLED or not count or not _recording():
        return
    from opentelemetry import trace

    attributes: Attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "receive",
        "messaging.operation.name": "claim_next",
        "messaging.destination.name": store,
        "messaging.destination.partition.id": partition_key,
        "messaging.consumer.group.name": group,
        "messaging.batch.message_count": count,
    }
    tracer = trace.get_tracer("pgactorbus", tracer_provider=_provider)
    tracer.start_span(f"claim {store}", kind=trace.SpanKind.CONSUMER, attributes=attributes).end()


@contextmanager
def processing(message: Message, group: str) -> Iterator[None]:
    """A CONSUMER span around a handler: child of the publisher's context, linked to it too."""
    if not processing_wanted(message):
        yield
        return
    from opentelemetry import propagate, trace

    parent = None
    links = []
    if "traceparent" in message.headers:
        parent = propagate.extract({k: message.headers[k] for k in _TRACE_HEADERS if k in message.headers})
        link = _link(message.headers)
        if link is not None:
            links.append(link)
    attributes: Attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": message.topic,
        "messaging.destination.partition.id": message.partition,
        "messaging.consumer.group.name": group,
        "messaging.message.id": message_id(message.topic, message.partition, message.offset),
        "messaging.message.delivery_attempt": message.attempt,
    }
    tracer = trace.get_tracer("pgactorbus", tracer_provider=_provider)
    with tracer.start_as_current_span(
        f"process {message.topic}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    ):
        yield
