"""Fuzzing the public API's input validation (hypothesis).

Arbitrary names (NUL, unicode, surrogates, long), partitions, offsets,
payloads, headers, keys, config values and start positions go into every
public entry point. Only `bus.BusError` subclasses may come out (never a
TypeError, an asyncpg error or a UnicodeError), and a refused call writes
nothing (the row count of every table of the schema and every partition's
offset counter are unchanged).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import bus
from bus.testing import FAST
from tests.helpers import bus_of_its_own

HUGE = b"x" * (1024 * 1024 + 1)  # one byte over the default max_message_bytes

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,  # deterministic per run: no example replay store in the working tree
)

# -- strategies -------------------------------------------------------------------------

weird_text = st.one_of(
    st.text(max_size=30),
    st.text(min_size=195, max_size=260, alphabet="ab.-_"),
    st.sampled_from(
        [
            "",
            "a\x00b",
            "\ud800",
            "caf\u00e9",
            "a b",
            "a;b",
            "a..b",
            "-x",
            ".x",
            "x" * 201,
            "Ω",
            "\n",
            "' OR 1=1 --",
            "ok-name",
            "a" * 200,
            "0",
        ]
    ),
)
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.binary(max_size=20),
    weird_text,
    st.lists(st.integers(), max_size=3),
    st.builds(object),
    st.just(2**63),
    st.just(-(2**63) - 1),
    st.just(float("nan")),
    st.just(float("inf")),
    st.just(datetime(2020, 1, 1)),
    st.just(timedelta(seconds=-1)),
)
names = st.one_of(weird_text, anything)
hashable = st.one_of(weird_text, st.integers(), st.none(), st.floats(), st.binary(max_size=4))
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64]),
    st.none(),
    st.booleans(),
    weird_text,
)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    weird_text,
    st.binary(max_size=10),
)
payloads = st.one_of(
    st.recursive(
        json_leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(
                st.one_of(weird_text, st.integers(), st.floats(), st.tuples(st.integers())), inner, max_size=4
            ),
            st.sets(st.integers(), max_size=3),
            st.frozensets(weird_text, max_size=3),
            st.tuples(inner),
        ),
        max_leaves=12,
    ),
    st.builds(object),
    st.just(HUGE),
    st.just(bytearray(b"ok")),
    st.just(memoryview(b"ok")),
)
headers = st.one_of(
    st.none(),
    st.dictionaries(weird_text, weird_text, max_size=3),
    st.dictionaries(hashable, anything, max_size=2),
    anything,
)
starts = st.one_of(
    st.sampled_from(["earliest", "latest", "all", "new", "EARLIEST", ""]),
    st.datetimes(),
    st.datetimes(timezones=st.just(UTC)),
    st.dictionaries(st.tuples(hashable, hashable), numbers, max_size=2),
    st.dictionaries(weird_text, numbers, max_size=2),
    anything,
)
partitions = st.one_of(st.none(), names, numbers, st.sampled_from(["0", "1", "2", "dev:1", "p@x=1"]))
TOPICS = ["fz-fixed", "fz-dyn", "fz-queue", "fz-compact"]
topic_names = st.one_of(st.sampled_from(TOPICS), names)


# -- fixtures -----------------------------------------------------------------------------

COUNT_TABLES = """
SELECT c.relname FROM pg_class c
WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r' ORDER BY 1
"""


class Fuzz:
    """A Bus on its own schema with a few topics, and a fingerprint of every table's row count."""

    def __init__(self, b: bus.Bus, dsn: str, schema: str, count_sql: str) -> None:
        self.b = b
        self.dsn = dsn
        self.schema = schema
        self._count_sql = count_sql

    async def fingerprint(self) -> tuple[Any, ...]:
        row = await self.b.pool.fetchrow(self._count_sql)
        assert row is not None
        return tuple(row)

    async def only_bus_errors(
        self, call: Callable[[], Awaitable[Any]], cleanup: Callable[[Any], Awaitable[Any]] | None = None
    ) -> Any:
        """Run `call`: it succeeds, or raises a BusError having written nothing. Anything else fails the test."""
        before = await self.fingerprint()
        try:
            result = await call()
        except bus.BusError:
            after = await self.fingerprint()
            assert after == before, f"a refused call wrote something: {before} -> {after}"
            return None
        if cleanup is not None:
            await cleanup(result)
        return result


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fz(dsn: str) -> AsyncIterator[Fuzz]:
    async with bus_of_its_own(dsn, "fz_", cleaner_interval=0, **FAST) as (b, schema):
        await b.create_topic("fz-fixed", partitions=3)
        await b.create_topic("fz-dyn", partitions=None, namespace="fzns", task="fztask")
        await b.create_topic("fz-queue", partitions=2, semantics="queue")
        await b.create_topic("fz-compact", partitions=1, cleanup="compact", max_message_bytes=4096)
        tables = [r[0] for r in await b.pool.fetch(COUNT_TABLES)]
        # Test-only SQL built from catalog names (quoted): one round trip per fingerprint.
        parts = [f'(SELECT count(*) FROM "{t}") AS "{t}"' for t in tables]
        parts.append("(SELECT COALESCE(sum(p.log_end), 0) FROM partitions p) AS offsets")
        yield Fuzz(b, dsn, schema, "SELECT " + ", ".join(parts))


# -- the fuzz tests ---------------------------------------------------------------------------


@SETTINGS
@given(
    name=names,
    partitions_=st.one_of(st.none(), numbers),
    semantics=st.one_of(st.sampled_from(["pubsub", "queue"]), names),
    cleanup=st.one_of(st.sampled_from(["delete", "compact"]), names),
    retention=st.one_of(st.none(), numbers, st.just(timedelta(days=1)), st.just(timedelta(0))),
    namespace=st.one_of(st.none(), names),
    max_message_bytes=st.one_of(st.none(), numbers),
)
@example(
    name="fz-big",
    partitions_=1,
    semantics="pubsub",
    cleanup="delete",
    retention=None,
    namespace=None,
    max_message_bytes=2**31,
)
@example(
    name="fz-nan",
    partitions_=1,
    semantics="pubsub",
    cleanup="delete",
    retention=float("nan"),
    namespace=None,
    max_message_bytes=None,
)
async def test_create_topic_refuses_bad_input_with_a_bus_error(
    fz: Fuzz,
    name: Any,
    partitions_: Any,
    semantics: Any,
    cleanup: Any,
    retention: Any,
    namespace: Any,
    max_message_bytes: Any,
) -> None:
    await fz.only_bus_errors(
        lambda: fz.b.create_topic(
            name,
            partitions_,
            semantics=semantics,
            cleanup=cleanup,
            retention=retention,
            namespace=namespace,
            max_message_bytes=max_message_bytes,
        )
    )


@SETTINGS
@given(
    topic=topic_names, payload=payloads, key=st.one_of(st.none(), names), partition=partitions, head=headers
)
@example(topic="fz-fixed", payload=b"x", key="\ud800", partition=None, head=None)
@example(topic="fz-fixed", payload={"k": "\ud800"}, key=None, partition=None, head=None)
@example(topic="fz-fixed", payload=b"x", key=None, partition=None, head={"k": "\ud800"})
@example(topic="fz-fixed", payload=2**70, key=None, partition=None, head=None)
async def test_publish_refuses_bad_input_with_a_bus_error(
    fz: Fuzz, topic: Any, payload: Any, key: Any, partition: Any, head: Any
) -> None:
    await fz.only_bus_errors(lambda: fz.b.publish(topic, payload, key=key, partition=partition, headers=head))


@SETTINGS
@given(
    topic=topic_names,
    messages=st.one_of(
        st.lists(
            st.one_of(
                st.builds(
                    bus.Outgoing,
                    payloads,
                    key=st.one_of(st.none(), names),
                    partition=partitions,
                    headers=headers,
                ),
                payloads,
            ),
            max_size=4,
        ),
        anything,
    ),
)
async def test_publish_many_refuses_bad_input_atomically(fz: Fuzz, topic: Any, messages: Any) -> None:
    await fz.only_bus_errors(lambda: fz.b.publish_many(topic, messages))


@SETTINGS
@given(topic=topic_names, partition=partitions, offset=numbers, max_messages=numbers)
@example(topic="fz-fixed", partition="0", offset=2**63, max_messages=10)
@example(topic="fz-dyn", partition="new-one", offset=2**64, max_messages=10)
async def test_read_refuses_bad_input_with_a_bus_error(
    fz: Fuzz, topic: Any, partition: Any, offset: Any, max_messages: Any
) -> None:
    await fz.only_bus_errors(
        lambda: fz.b.read(topic, partition=partition, offset=offset, max_messages=max_messages)
    )


@settings(SETTINGS, max_examples=40)
@given(
    group=names,
    topics=st.one_of(st.none(), st.lists(topic_names, max_size=2), anything),
    start=starts,
    max_poll_records=numbers,
    assignor=st.one_of(st.sampled_from(["range", "roundrobin", "sticky"]), names),
    instance_id=st.one_of(st.none(), names),
)
@example(
    group="g",
    topics=["fz-fixed"],
    start={("fz-fixed", "0"): 2**63},
    max_poll_records=10,
    assignor="range",
    instance_id=None,
)
@example(
    group="g",
    topics=["fz-fixed"],
    start={("fz-fixed", "0"): -1},
    max_poll_records=10,
    assignor="range",
    instance_id=None,
)
@example(group="g", topics=object(), start=None, max_poll_records=10, assignor="range", instance_id=None)
async def test_consumer_refuses_bad_input_with_a_bus_error(
    fz: Fuzz, group: Any, topics: Any, start: Any, max_poll_records: Any, assignor: Any, instance_id: Any
) -> None:
    async def make() -> Any:
        c = fz.b.consumer(
            group,
            topics=topics,
            start=start,
            max_poll_records=max_poll_records,
            assignor=assignor,
            instance_id=instance_id,
        )
        try:
            await c.start()
        except BaseException:
            await c.close()
            raise
        return c

    async def close(c: Any) -> None:
        await c.close()

    await fz.only_bus_errors(make, close)


@SETTINGS
@given(
    group=names,
    topic=st.one_of(st.none(), topic_names),
    namespace=st.one_of(st.none(), st.just("fzns"), names),
    worker_id=names,
    max_messages=numbers,
    lease_time=st.one_of(st.none(), numbers),
    start=st.one_of(st.none(), starts),
)
@example(
    group="g",
    topic="fz-fixed",
    namespace=None,
    worker_id="w",
    max_messages=1,
    lease_time=float("inf"),
    start=None,
)
@example(
    group="g",
    topic="fz-fixed",
    namespace=None,
    worker_id="w",
    max_messages=1,
    lease_time=float("nan"),
    start=None,
)
@example(
    group="g", topic="fz-fixed", namespace=None, worker_id="w", max_messages=1, lease_time=1e300, start=None
)
async def test_claim_refuses_bad_input_with_a_bus_error(
    fz: Fuzz,
    group: Any,
    topic: Any,
    namespace: Any,
    worker_id: Any,
    max_messages: Any,
    lease_time: Any,
    start: Any,
) -> None:
    await fz.only_bus_errors(
        lambda: fz.b.claim(
            group,
            topic=topic,
            namespace=namespace,
            worker_id=worker_id,
            max_messages=max_messages,
            lease_time=lease_time,
            start=start,
        )
    )


@SETTINGS
@given(
    topic=topic_names,
    visibility_timeout=numbers,
    max_attempts=numbers,
    dead_letter=st.one_of(st.none(), names),
    take=numbers,
    timeout=numbers,
)
@example(
    topic="fz-queue", visibility_timeout=float("inf"), max_attempts=1, dead_letter=None, take=1, timeout=0
)
@example(
    topic="fz-queue", visibility_timeout=1.0, max_attempts=1, dead_letter=None, take=1, timeout=float("nan")
)
async def test_queue_consumer_refuses_bad_input_with_a_bus_error(
    fz: Fuzz,
    topic: Any,
    visibility_timeout: Any,
    max_attempts: Any,
    dead_letter: Any,
    take: Any,
    timeout: Any,  # noqa: ASYNC109
) -> None:
    async def open_() -> Any:
        q = fz.b.queue_consumer(
            topic, visibility_timeout=visibility_timeout, max_attempts=max_attempts, dead_letter=dead_letter
        )
        await q.start()  # may create the dead-letter topic: a valid write
        return q

    q = await fz.only_bus_errors(open_)
    if q is None:
        return
    try:
        # A tiny timeout keeps the example short; a huge or odd one must be refused, not slept on.
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0.01:
            timeout = 0.0
        await fz.only_bus_errors(lambda: q.take(max_messages=take, timeout=timeout))
    finally:
        await q.close()


class FuzzEvent(bus.Event, tag="fuzz.thing"):
    thing: str


@SETTINGS
@given(
    store=names,
    group=names,
    partition_by=st.one_of(st.lists(names, max_size=2), anything),
    handled=st.one_of(st.lists(st.one_of(st.just(FuzzEvent), anything), max_size=2), anything),
    worker_id=names,
    events=st.one_of(
        st.lists(st.one_of(st.builds(FuzzEvent, thing=weird_text), anything), max_size=2), anything
    ),
)
@example(store="s", group="g", partition_by=None, handled=[FuzzEvent], worker_id="w", events=[])
@example(store="s", group="g", partition_by=["thing"], handled=object(), worker_id="w", events=[])
@example(store="s", group="g", partition_by=True, handled=[FuzzEvent], worker_id="w", events=float("nan"))
async def test_event_store_refuses_bad_input_with_a_bus_error(
    fz: Fuzz, store: Any, group: Any, partition_by: Any, handled: Any, worker_id: Any, events: Any
) -> None:
    async def append() -> Any:
        return await fz.b.event_store(store).append(events)

    async def register() -> Any:
        return await fz.b.event_store(store).register_group(group)

    async def claim() -> Any:
        s = fz.b.event_store(store)
        return await s.claim_next(
            group, partition_by=partition_by, handled_types=handled, worker_id=worker_id
        )

    async def read() -> Any:
        return await fz.b.event_store(store).read(conditions=partition_by, after=0)

    for call in (append, register, claim, read):
        await fz.only_bus_errors(call)


@SETTINGS
@given(group=names, to=anything, topic=st.one_of(st.none(), topic_names), older_than=numbers)
@example(group="g", to=2**63, topic=None, older_than=1.0)
@example(group="g", to="earliest", topic=None, older_than=None)
@example(group="g", to="earliest", topic=None, older_than=float("nan"))
async def test_admin_refuses_bad_input_with_a_bus_error(
    fz: Fuzz, group: Any, to: Any, topic: Any, older_than: Any
) -> None:
    a = fz.b.admin
    await fz.only_bus_errors(lambda: a.describe_group(group))
    await fz.only_bus_errors(lambda: a.reset_offsets(group, to=to, topic=topic))
    await fz.only_bus_errors(lambda: a.force_complete("fz-fixed" if topic is None else topic, older_than))
    await fz.only_bus_errors(lambda: a.topic_stats(topic))


CONFIG_KEYS = list(bus.Config.__struct_fields__)


@settings(SETTINGS, max_examples=50)
@given(
    schema=st.one_of(names, st.text(alphabet="abc_", min_size=64, max_size=70)),
    config=st.dictionaries(
        st.one_of(st.sampled_from([k for k in CONFIG_KEYS if k != "schema"]), weird_text), numbers, max_size=3
    ),
)
@example(schema="ok", config={"heartbeat_interval": float("nan")})
@example(schema="ok", config={"pool_max_size": -5})
@example(schema="ok", config={"session_timeout": float("inf"), "heartbeat_interval": 1.0})
async def test_connect_refuses_bad_schema_and_config_with_a_bus_error(
    fz: Fuzz, schema: Any, config: Any
) -> None:
    try:
        bus.Config.load({"schema": schema, **config}, environ={})
    except bus.BusError:
        pass
    # A valid schema name must not reach the database here: the config is always invalid
    # (cleaner_interval is a number, so a text value is refused), or the schema is.
    config = dict(config)
    valid_schema = (
        isinstance(schema, str) and schema.isidentifier() and schema.isascii() and len(schema) <= 63
    )
    if valid_schema and not any(isinstance(v, str) and not _is_number(v) for v in config.values()):
        config["cleaner_interval"] = "not-a-number"
    connected: list[bus.Bus] = []

    async def run() -> Any:
        b = await bus.connect(fz.dsn, schema=schema, **config)
        connected.append(b)
        return b

    try:
        await fz.only_bus_errors(run)
    finally:
        for b in connected:
            await b.close()
    assert not connected or connected[0].config.schema != fz.schema  # never reached: config always invalid


def _is_number(text: str) -> bool:
    try:
        return not math.isnan(float(text))
    except ValueError:
        return False


@settings(SETTINGS, max_examples=200)
@given(config=st.dictionaries(st.sampled_from(CONFIG_KEYS), st.one_of(numbers, weird_text), max_size=4))
@example(config={"heartbeat_interval": float("nan")})
@example(config={"rebalance_delay": float("-inf")})
@example(config={"pool_min_size": 5, "pool_max_size": 2})
@example(config={"max_message_bytes": 2**31})
@example(config={"cleaner_interval": float("nan")})
@example(config={"heartbeat_interval": "\ud800"})
def test_config_values_are_checked_before_anything_connects(config: dict[str, Any]) -> None:
    try:
        c = bus.Config.load(config, environ={})
    except bus.BusError:
        return
    for name in (
        "heartbeat_interval",
        "session_timeout",
        "lease_time",
        "max_poll_interval",
        "rebalance_delay",
    ):
        assert math.isfinite(getattr(c, name)) and getattr(c, name) >= 0
    assert 0 <= c.pool_min_size <= c.pool_max_size and 0 < c.max_message_bytes <= 1 << 30


def test_payload_strategy_covers_what_json_cannot_hold() -> None:
    # A guard on the fuzzer itself: objects must be among what it tries, and msgspec refuses them.
    with pytest.raises(TypeError):
        msgspec.json.encode(object())
