"""OpenTelemetry: a publish -> handler -> publish -> handler chain is one trace, with the messaging conventions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import bus
from bus import tracing
from bus.testing import eventually


@pytest.fixture
def tracer_provider() -> Iterator[TracerProvider]:
    """The tracer provider the bus is told to use (`tracing.use_tracer_provider`) for the test."""
    provider = TracerProvider()
    tracing.use_tracer_provider(provider)
    try:
        yield provider
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
def spans(tracer_provider: TracerProvider) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def test_a_publish_handler_publish_chain_is_one_trace(
    connect, fast, spans: InMemorySpanExporter, tracer_provider: TracerProvider
) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=2)
    await b.create_topic("emails", partitions=1)
    delivered: list[bus.Message] = []

    async def on_order(m: bus.Message) -> None:
        await b.publish("emails", {"to": m.value(dict)["id"]})

    async def on_email(m: bus.Message) -> None:
        delivered.append(m)

    s1 = await b.subscribe("billing", on_order, topics=["orders"])
    s2 = await b.subscribe("mailer", on_email, topics=["emails"])
    tracer = trace.get_tracer("test", tracer_provider=tracer_provider)
    with tracer.start_as_current_span("http request") as root:
        await b.publish("orders", {"id": 7}, key="cust-7")
    await eventually(lambda: len(delivered) == 1)
    await s1.stop()
    await s2.stop()
    # The trace context travels in the headers, W3C style.
    assert delivered[0].headers["traceparent"].startswith("00-")

    finished = {s.name: s for s in spans.get_finished_spans()}
    chain = ["http request", "publish orders", "process orders", "publish emails", "process emails"]
    assert set(chain) <= set(finished), sorted(finished)
    trace_id = root.get_span_context().trace_id
    for parent, child in zip(chain, chain[1:], strict=False):
        span = finished[child]
        assert span.context.trace_id == trace_id
        assert span.parent is not None and span.parent.span_id == finished[parent].context.span_id, child
    process = finished["process orders"]
    assert process.kind == trace.SpanKind.CONSUMER
    assert finished["publish orders"].kind == trace.SpanKind.PRODUCER
    # Linked to the publisher's span as well (the conventions' link for consumers).
    assert [link.context.span_id for link in process.links] == [finished["publish orders"].context.span_id]
    attrs = process.attributes or {}
    assert attrs["messaging.system"] == "pgactorbus"
    assert attrs["messaging.destination.name"] == "orders"
    assert attrs["messaging.consumer.group.name"] == "billing"
    assert str(attrs["messaging.message.id"]).startswith("orders/")
    assert finished["publish orders"].attributes["messaging.destination.name"] == "orders"


async def test_a_poll_records_one_receive_span_linked_to_each_publisher(
    connect, fast, spans: InMemorySpanExporter
) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [bus.Outgoing({"i": i}) for i in range(3)])
    async with b.consumer("g", topics=["t"]) as c:
        got: list[bus.Message] = []

        async def all_three() -> bool:
            got.extend(await c.poll(timeout=0.1))
            return len(got) >= 3

        await eventually(all_three)
    publish = [s for s in spans.get_finished_spans() if s.name == "publish t"]
    receive = [s for s in spans.get_finished_spans() if s.name == "poll t"]
    assert len(publish) == 1 and publish[0].attributes["messaging.batch.message_count"] == 3
    assert receive, [s.name for s in spans.get_finished_spans()]
    assert sum(int(s.attributes["messaging.batch.message_count"]) for s in receive) == 3
    assert {link.context.span_id for s in receive for link in s.links} == {publish[0].context.span_id}
    assert all(s.attributes["messaging.consumer.group.name"] == "g" for s in receive)


async def test_claims_and_queue_takes_record_spans_linked_to_their_publishers(
    connect, fast, spans: InMemorySpanExporter
) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=1)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("orders", {"id": 1})
    await b.publish("jobs", {"task": "resize"})
    claim = await b.claim("reporting", topic="orders", worker_id="w-1")
    assert claim is not None
    await claim.ack()
    async with b.queue_consumer("jobs") as q:
        jobs = await q.take(max_messages=10, timeout=5.0)
        assert len(jobs) == 1
        await q.ack(jobs[0])
    finished = {s.name: s for s in spans.get_finished_spans()}
    for receive, publish in (("claim orders", "publish orders"), ("take jobs", "publish jobs")):
        span = finished[receive]
        assert span.kind == trace.SpanKind.CONSUMER
        assert [link.context.span_id for link in span.links] == [finished[publish].context.span_id]
        assert span.attributes["messaging.batch.message_count"] == 1
    assert finished["claim orders"].attributes["messaging.consumer.group.name"] == "reporting"


async def test_an_event_store_claim_records_a_span(connect, fast, spans: InMemorySpanExporter) -> None:
    b = await connect(**fast)

    class Opened(bus.Event, tag="tracing.opened"):
        account: str

    store = b.event_store("accounts")
    await store.append([Opened(account="a-1"), Opened(account="a-1")])
    await store.register_group("audit")
    claim = await store.claim_next("audit", partition_by=["account"], handled_types=[Opened], worker_id="w-1")
    assert claim is not None
    span = next(s for s in spans.get_finished_spans() if s.name == "claim accounts")
    assert span.attributes["messaging.consumer.group.name"] == "audit"
    assert span.attributes["messaging.batch.message_count"] == 2


async def test_without_a_tracer_provider_nothing_is_added_but_a_parent_context_goes_on(b: bus.Bus) -> None:
    from opentelemetry import context, propagate

    await b.create_topic("t")
    # Nothing records and no context is current: the publish carries no trace headers.
    await b.publish("t", b"plain")
    # A service that only passes trace context on (no SDK) still has it carried, as the API does.
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    token = context.attach(propagate.extract({"traceparent": parent}))
    try:
        await b.publish("t", b"carried")
    finally:
        context.detach(token)
    plain, carried = await b.read("t")
    assert "traceparent" not in plain.headers
    assert carried.headers.get("traceparent") == parent
