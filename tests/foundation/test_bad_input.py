"""Bad input is refused with a typed error that says what to do, and nothing is written."""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import bus
from storage.names import validate_name

Counts = Callable[[], Awaitable[dict[str, int]]]

BAD_NAMES: list[Any] = [
    "",
    "x" * 201,
    "a;b",
    "a b",
    "a..b",
    "a\x00b",
    "-leading-dash",
    ".hidden",
    "tab\there",
    "naïve",
    "x'; DROP TABLE topics; --",
    5,
    None,
    b"bytes",
]


def test_names_of_200_characters_are_accepted() -> None:
    assert validate_name("a" * 200) == "a" * 200
    assert validate_name("Orders.v2_eu-1") == "Orders.v2_eu-1"


async def test_bad_topic_names_are_refused_and_nothing_is_written(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("ok", partitions=None)
    before = await counts()
    for name in BAD_NAMES:
        calls: list[Callable[..., Awaitable[Any]]] = [
            lambda name=name: b.create_topic(name),
            lambda name=name: b.publish(name, b"x"),
            lambda name=name: b.publish_many(name, [b"x"]),
            lambda name=name: b.read(name),
            lambda name=name: b.delete_topic(name),
        ]
        if name is not None:  # None is "no label" for these
            calls += [
                lambda name=name: b.list_topics(namespace=name),
                lambda name=name: b.list_topics(task=name),
                lambda name=name: b.create_topic("ok2", namespace=name),
                lambda name=name: b.create_topic("ok2", task=name),
            ]
        for call in calls:
            with pytest.raises(bus.ValidationError, match="use 1 to 200 ASCII letters"):
                await call()
    assert await counts() == before


async def test_bad_partition_names_are_refused_and_nothing_is_written(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("dyn", partitions=None)
    await b.create_topic("fixed", partitions=2)
    before = await counts()
    # None means "choose one for me"; an int n means the partition named str(n).
    names = [n for n in BAD_NAMES if n is not None and not isinstance(n, int)] + [-1, 2.0]
    for topic, name in [(t, n) for t in ("dyn", "fixed") for n in names]:
        with pytest.raises(bus.ValidationError, match="partition"):
            await b.publish(topic, b"x", partition=name)
        with pytest.raises(bus.ValidationError, match="partition"):
            await b.publish_many(topic, [bus.Outgoing(b"x", partition=name)])
        with pytest.raises(bus.ValidationError, match="partition"):
            await b.read(topic, partition=name)
    assert await counts() == before


async def test_a_fixed_partition_outside_the_topic_is_refused(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("fixed", partitions=2)
    before = await counts()
    for partition in ("2", 2, "01", "-1", "customer-1"):
        with pytest.raises(bus.ValidationError, match="'0'..'1'|invalid partition"):
            await b.publish("fixed", b"x", partition=partition)
    with pytest.raises(bus.ValidationError, match="no partition"):
        await b.read("fixed", partition="2")
    assert await counts() == before


async def test_bad_group_names_are_refused(b: bus.Bus) -> None:
    for name in BAD_NAMES:
        with pytest.raises(bus.ValidationError, match="group name"):
            validate_name(name, "group name")
    if importlib.util.find_spec("bus.claims") is None:
        return  # the claim API is not there yet; the validator above is what it uses
    await b.create_topic("t")
    for name in BAD_NAMES:
        with pytest.raises(bus.ValidationError):
            await b.claim(name, topic="t", worker_id="w-1")
    assert await b.pool.fetchval("SELECT count(*) FROM groups") == 0


async def test_bad_offsets_and_read_sizes_are_refused(b: bus.Bus) -> None:
    await b.create_topic("t")
    for offset in (-1, -(2**40), 1.5, "3", True, None):
        with pytest.raises(bus.ValidationError, match="integer >= 0"):
            await b.read("t", offset=offset)  # type: ignore[arg-type]
    for max_messages in (0, -5, 100_001, 2.0, True):
        with pytest.raises(bus.ValidationError, match="max_messages"):
            await b.read("t", max_messages=max_messages)  # type: ignore[arg-type]


async def test_bad_partition_counts_are_refused_and_nothing_is_written(b: bus.Bus, counts: Counts) -> None:
    before = await counts()
    for partitions in (0, -1, 1.5, "4", True, 100_001):
        with pytest.raises(bus.ValidationError, match="partitions must be an integer from 1"):
            await b.create_topic("t", partitions=partitions)  # type: ignore[arg-type]
    assert await counts() == before


async def test_bad_topic_settings_are_refused_and_nothing_is_written(b: bus.Bus, counts: Counts) -> None:
    before = await counts()
    for kwargs in (
        {"semantics": "fanout"},
        {"cleanup": "forever"},
        {"retention": -3},
        {"retention": "7d"},
        {"max_message_bytes": 0},
        {"max_message_bytes": "big"},
    ):
        with pytest.raises(bus.ValidationError, match="must"):
            await b.create_topic("t", **kwargs)  # type: ignore[arg-type]
    assert await counts() == before


async def test_unencodable_payloads_are_refused_and_nothing_is_written(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("t")
    before = await counts()
    for payload in (object(), {1, 2}, frozenset({"a"}), {"nested": object()}, {"nested": {2}}, [1, {3}]):
        with pytest.raises(bus.ValidationError, match="pass bytes, a msgspec.Struct"):
            await b.publish("t", payload)
        with pytest.raises(bus.ValidationError, match="pass bytes, a msgspec.Struct"):
            await b.publish_many("t", [b"fine", payload])
    assert await counts() == before


async def test_bad_keys_and_headers_are_refused_and_nothing_is_written(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("t")
    before = await counts()
    for kwargs, match in (
        ({"key": 42}, "key must be a str"),
        ({"key": "a\x00b"}, "NUL"),
        ({"headers": {"a": 1}}, "headers must be a dict of str to str"),
        ({"headers": [("a", "b")]}, "headers must be a dict"),
        ({"headers": {"a": "b\x00"}}, "NUL"),
    ):
        with pytest.raises(bus.ValidationError, match=match):
            await b.publish("t", b"x", **kwargs)  # type: ignore[arg-type]
    assert await counts() == before


async def test_publish_many_refuses_a_non_list(b: bus.Bus) -> None:
    await b.create_topic("t")
    with pytest.raises(bus.ValidationError, match="list of bus.Outgoing"):
        await b.publish_many("t", b"not a list")  # type: ignore[arg-type]


async def test_unknown_topics_raise_topic_not_found_saying_how_to_create_them(
    b: bus.Bus, counts: Counts
) -> None:
    before = await counts()
    for call in (
        lambda: b.publish("ghost", b"x"),
        lambda: b.publish_many("ghost", [b"x"]),
        lambda: b.read("ghost"),
    ):
        with pytest.raises(bus.TopicNotFoundError, match=r"create it with create_topic\('ghost'"):
            await call()
    assert await counts() == before


async def test_unknown_configuration_keys_are_refused(dsn: str) -> None:
    with pytest.raises(bus.ValidationError, match="valid keys are"):
        await bus.connect(dsn, hearbeat_interval=1.0)
    with pytest.raises(bus.ValidationError, match="heartbeat_interval must be shorter"):
        await bus.connect(dsn, heartbeat_interval=20.0, session_timeout=10.0)


async def test_sql_injection_in_a_topic_name_is_refused_and_the_tables_survive(b: bus.Bus) -> None:
    for name in (
        "x'; DROP TABLE topics; --",
        'x"; DROP TABLE messages; --',
        "x); DELETE FROM partitions; --",
    ):
        with pytest.raises(bus.ValidationError):
            await b.create_topic(name)
    await b.create_topic("t")
    assert [t.name for t in await b.list_topics()] == ["t"]


async def test_sql_text_in_keys_headers_and_payloads_round_trips_verbatim(b: bus.Bus) -> None:
    await b.create_topic("t")
    await b.create_topic("d", partitions=None)
    evil = "x'); DROP TABLE messages; -- $1 \\' \" ;"
    await b.publish("t", evil.encode(), key=evil, headers={evil: evil})
    await b.publish("t", {"q": evil})
    first, second = await b.read("t")
    assert (first.payload, first.key, first.headers) == (evil.encode(), evil, {evil: evil})
    assert second.value() == {"q": evil}
    # A key used as a dynamic partition name is validated like any partition name.
    rec = await b.publish("d", b"x", key=evil)
    assert rec.partition != evil
    [m] = await b.read("d", partition=rec.partition)
    assert m.key == evil
