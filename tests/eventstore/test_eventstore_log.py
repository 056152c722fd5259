"""The store's log: appends, positions, the attribute index, guards and ad-hoc reads."""

from __future__ import annotations

import asyncio

import pytest

import bus
from bus.eventstore import EventStore
from tests.conftest import Connect
from tests.eventstore.es_events import Counted, CourseClosed, CourseCreated, UserJoinedCourse


async def test_append_returns_dense_positions_from_one(store: EventStore) -> None:
    first = await store.append(CourseCreated(course_name="Algebra"))
    more = await store.append([CourseClosed(course_name="Algebra"), CourseCreated(course_name="History")])
    assert [p.position for p in first + more] == [1, 2, 3]
    assert more[0].message == CourseClosed(course_name="Algebra")
    assert await store.last_position() == 3


async def test_stores_have_independent_logs(es_bus: bus.Bus, store: EventStore) -> None:
    a, other = store, es_bus.event_store(store.name + "-b")
    await a.append(CourseCreated(course_name="x"))
    recs = await other.append(CourseCreated(course_name="y"))
    assert recs[0].position == 1
    assert [e.message for e in await a.read()] == [CourseCreated(course_name="x")]


async def test_read_without_conditions_returns_every_event_after_the_position(store: EventStore) -> None:
    await store.append([CourseCreated(course_name=c) for c in "abc"])
    assert [e.position for e in await store.read()] == [1, 2, 3]
    assert [e.message for e in await store.read(after=2)] == [CourseCreated(course_name="c")]
    assert [e.position for e in await store.read(limit=2)] == [1, 2]


async def test_read_with_conditions_returns_events_matching_any_of_them(store: EventStore) -> None:
    await store.append(
        [
            CourseCreated(course_name="Algebra"),
            UserJoinedCourse(course_name="Algebra", user_id="joe"),
            CourseCreated(course_name="History"),
            UserJoinedCourse(course_name="History", user_id="jake"),
        ]
    )
    found = await store.read(
        CourseCreated.to_conditions(course_name="Algebra") + UserJoinedCourse.to_conditions(user_id="jake")
    )
    assert [e.position for e in found] == [1, 4]
    assert await store.read([]) == []


async def test_scalar_attributes_are_indexed_as_text_and_none_is_not(store: EventStore) -> None:
    await store.append([Counted(count=42, enabled=True), Counted(count=7, enabled=False, note="n")])
    assert [e.position for e in await store.read(Counted.to_conditions(count=42))] == [1]
    assert [e.position for e in await store.read(Counted.to_conditions(enabled=False))] == [2]
    assert [e.message for e in await store.read(Counted.to_conditions(note="n"))] == [
        Counted(count=7, enabled=False, note="n")
    ]


async def test_append_of_a_list_is_atomic_when_one_item_is_invalid(store: EventStore) -> None:
    with pytest.raises(bus.ValidationError, match="bus.Event"):
        await store.append([CourseCreated(course_name="ok"), {"course_name": "not an event"}])  # type: ignore[list-item]
    assert await store.read() == []
    assert await store.last_position() == 0


async def test_append_refuses_an_untagged_event_and_a_nul_character(store: EventStore) -> None:
    class Untagged(bus.Event):
        x: str

    with pytest.raises(bus.ValidationError, match="no tag"):
        await store.append(Untagged(x="1"))
    with pytest.raises(bus.ValidationError, match="NUL"):
        await store.append(CourseCreated(course_name="a\x00b"))
    assert await store.read() == []


async def test_guard_allows_an_append_when_nothing_matching_was_appended(store: EventStore) -> None:
    await store.append(CourseCreated(course_name="Algebra"))
    guard = bus.Guard(CourseClosed.to_conditions(course_name="Algebra"), position=1)
    await store.append(CourseCreated(course_name="History"))  # does not match the guard
    recs = await store.append(CourseClosed(course_name="Algebra"), guard=guard)
    assert recs[0].position == 3


async def test_guard_rejects_an_append_after_a_matching_event_and_writes_nothing(store: EventStore) -> None:
    await store.append(CourseCreated(course_name="Algebra"))
    guard = bus.Guard(CourseClosed.to_conditions(course_name="Algebra"), position=1)
    await store.append(CourseClosed(course_name="Algebra"))
    with pytest.raises(bus.ConcurrentAppendError, match="position 2"):
        await store.append(
            [CourseCreated(course_name="Algebra-2"), CourseClosed(course_name="Algebra")], guard=guard
        )
    assert await store.last_position() == 2
    # The refused append took no position: the next one is dense.
    assert (await store.append(CourseCreated(course_name="x")))[0].position == 3


async def test_concurrent_appends_get_dense_unique_positions(store: EventStore) -> None:
    async def writer(i: int) -> list[int]:
        positions = []
        for j in range(10):
            recs = await store.append(
                [CourseCreated(course_name=f"{i}-{j}"), CourseClosed(course_name=f"{i}-{j}")]
            )
            positions += [r.position for r in recs]
        return positions

    results = await asyncio.gather(*(writer(i) for i in range(8)))
    everything = sorted(p for r in results for p in r)
    assert everything == list(range(1, 161))


async def test_positions_become_visible_in_order_to_a_concurrent_reader(store: EventStore) -> None:
    done = asyncio.Event()

    async def writer() -> None:
        for i in range(60):
            await store.append(CourseCreated(course_name=str(i)))
        done.set()

    async def reader() -> None:
        seen = 0
        while not done.is_set() or seen < 60:
            # A reader that has seen position n never later finds a new event at or below n.
            fresh = await store.read(after=seen)
            assert [e.position for e in fresh] == list(range(seen + 1, seen + 1 + len(fresh)))
            seen += len(fresh)

    await asyncio.gather(writer(), writer(), writer(), reader())


async def test_conflicting_guarded_appends_from_two_connections_exactly_one_wins(connect: Connect) -> None:
    b1, b2 = await connect(), await connect()
    s1, s2 = b1.event_store("race"), b2.event_store("race")
    for round_ in range(30):
        course = f"c{round_}"
        position = await s1.last_position()
        guard = bus.Guard(UserJoinedCourse.to_conditions(course_name=course), position)
        results = await asyncio.gather(
            s1.append(UserJoinedCourse(course_name=course, user_id="joe"), guard=guard),
            s2.append(UserJoinedCourse(course_name=course, user_id="jake"), guard=guard),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1, results
        assert isinstance(errors[0], bus.ConcurrentAppendError)
        assert len(await s1.read(UserJoinedCourse.to_conditions(course_name=course))) == 1
    assert await s1.last_position() == 30


async def test_non_conflicting_guarded_appends_from_two_connections_both_succeed(connect: Connect) -> None:
    b1, b2 = await connect(), await connect()
    s1, s2 = b1.event_store("race"), b2.event_store("race")
    for round_ in range(10):
        position = await s1.last_position()
        await asyncio.gather(
            s1.append(
                CourseClosed(course_name=f"a{round_}"),
                guard=bus.Guard(CourseClosed.to_conditions(course_name=f"a{round_}"), position),
            ),
            s2.append(
                CourseClosed(course_name=f"b{round_}"),
                guard=bus.Guard(CourseClosed.to_conditions(course_name=f"b{round_}"), position),
            ),
        )
    assert await s1.last_position() == 20


async def test_bad_guard_and_bad_read_arguments_raise_validation_errors(
    es_bus: bus.Bus, store: EventStore
) -> None:
    with pytest.raises(bus.ValidationError, match="Guard"):
        await store.append(CourseCreated(course_name="x"), guard=("not", "a guard"))  # type: ignore[arg-type]
    with pytest.raises(bus.ValidationError, match="QueryCondition"):
        await store.append(CourseCreated(course_name="x"), guard=bus.Guard([("a", "b", "c")], 0))  # type: ignore[list-item]
    with pytest.raises(bus.ValidationError, match="after"):
        await store.read(after=-1)
    with pytest.raises(bus.ValidationError, match="event store name"):
        bus.EventStore(es_bus.context, "bad name; drop")
    assert await store.read() == []
