"""Consumer groups of the event store: the seed's lifecycle, claim_next, ack/release tests (1-32)."""

from __future__ import annotations

import asyncio

import pytest

import bus
from bus.eventstore import EventStore
from bus.testing import Clock
from storage import eventstore as es_sql
from tests.conftest import Connect, plan_modes
from tests.eventstore.es_events import (
    COURSE_TYPES,
    CourseClosed,
    CourseCreated,
    DeviceReading,
    DeviceRenamed,
    UserJoinedCourse,
    UserRegistered,
)

DEVICE = "device_id"
DEVICE_TYPES = [DeviceReading, DeviceRenamed]
COMPOSITE = ["course_name", "user_id"]


async def claim_device(
    store: EventStore, group: str, worker: str = "w-1", **kw: object
) -> bus.EventClaim | None:
    return await store.claim_next(
        group, partition_by=DEVICE, handled_types=DEVICE_TYPES, worker_id=worker, **kw
    )  # type: ignore[arg-type]


async def claim_course(store: EventStore, group: str, worker: str = "w-1") -> bus.EventClaim | None:
    return await store.claim_next(group, partition_by=COMPOSITE, handled_types=COURSE_TYPES, worker_id=worker)


def positions(claim: bus.EventClaim | None) -> list[int]:
    assert claim is not None
    return [m.position for m in claim.messages]


# -- lifecycle (1-5) ---------------------------------------------------------------


async def test_register_group_creates_an_active_group(store: EventStore) -> None:
    await store.register_group("g")
    assert await store.group_status("g") == "active"


async def test_register_group_is_idempotent(store: EventStore) -> None:
    await store.register_group("g")
    await store.stop_group("g")
    await store.register_group("g")  # registering again changes nothing, not even the status
    assert await store.group_status("g") == "stopped"


async def test_group_active_is_true_when_active_and_false_when_stopped_or_unknown(store: EventStore) -> None:
    await store.register_group("g")
    assert await store.group_active("g") is True
    await store.stop_group("g")
    assert await store.group_active("g") is False
    assert await store.group_active("nobody") is False


async def test_stop_and_start_group_toggle_its_status(store: EventStore, group: str) -> None:
    await store.stop_group(group)
    assert await store.group_status(group) == "stopped"
    await store.start_group(group)
    assert await store.group_status(group) == "active"
    with pytest.raises(bus.GroupNotFoundError, match="register_group"):
        await store.stop_group("nobody")


async def test_reset_group_deletes_every_offset_and_reprocesses_from_the_start(
    store: EventStore, group: str
) -> None:
    await store.append([DeviceReading(device_id="d1", value=1.0), DeviceReading(device_id="d2", value=2.0)])
    c = await claim_device(store, group)
    assert c is not None
    await store.ack(group, c.offset_id, c.messages[-1].position)
    assert len(await store.partitions(group)) == 2
    await store.reset_group(group)
    assert await store.partitions(group) == []
    again = await claim_device(store, group)
    assert again is not None and again.partition_value == {"device_id": "d1"}


# -- claim_next, one attribute (6-19) ----------------------------------------------------


async def test_claim_next_bootstraps_offsets_for_new_partitions(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id=d, value=0.0) for d in ("d1", "d2", "d3")])
    await claim_device(store, group)
    cursors = await store.partitions(group)
    assert sorted(c.partition_key for c in cursors) == ["device_id:d1", "device_id:d2", "device_id:d3"]
    assert all(c.position == 0 for c in cursors)


async def test_claim_next_returns_none_when_nothing_is_pending(store: EventStore, group: str) -> None:
    assert await claim_device(store, group) is None
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await claim_device(store, group)
    assert c is not None
    await store.ack(group, c.offset_id, c.messages[-1].position)
    assert await claim_device(store, group) is None


async def test_claim_next_returns_the_partition_with_its_events_and_a_guard(
    store: EventStore, group: str
) -> None:
    await store.append(DeviceReading(device_id="d1", value=1.5))
    c = await claim_device(store, group)
    assert c is not None
    assert isinstance(c.offset_id, int)
    assert c.partition_key == "device_id:d1"
    assert c.partition_value == {"device_id": "d1"}
    assert len(c.messages) == 1 and isinstance(c.messages[0], bus.PositionedEvent)
    assert c.messages[0].message == DeviceReading(device_id="d1", value=1.5)
    assert c.messages[0].position == 1 and c.messages[0].created_at is not None
    assert isinstance(c.guard, bus.Guard) and c.guard.position == 1


async def test_claim_next_returns_every_pending_event_of_the_partition(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id="d1", value=float(i)) for i in range(5)])
    c = await claim_device(store, group)
    assert positions(c) == [1, 2, 3, 4, 5]


async def test_a_second_worker_gets_a_different_partition(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id="d1", value=0.0), DeviceReading(device_id="d2", value=0.0)])
    first, second = await claim_device(store, group, "w-1"), await claim_device(store, group, "w-2")
    assert first is not None and second is not None
    assert {first.partition_key, second.partition_key} == {"device_id:d1", "device_id:d2"}


async def test_claim_next_returns_none_when_every_partition_is_claimed(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id="d1", value=0.0), DeviceReading(device_id="d2", value=0.0)])
    assert await claim_device(store, group, "w-1") is not None
    assert await claim_device(store, group, "w-2") is not None
    assert await claim_device(store, group, "w-3") is None


async def test_claim_next_only_returns_handled_types(store: EventStore, group: str) -> None:
    await store.append(
        [DeviceRenamed(device_id="d1", name="kitchen"), DeviceReading(device_id="d1", value=3.0)]
    )
    c = await store.claim_next(group, partition_by=DEVICE, handled_types=[DeviceReading], worker_id="w-1")
    assert c is not None
    assert [m.message for m in c.messages] == [DeviceReading(device_id="d1", value=3.0)]


async def test_claim_next_only_returns_events_after_the_acked_position(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id="d1", value=float(i)) for i in range(3)])
    c = await claim_device(store, group)
    assert c is not None
    await store.ack(group, c.offset_id, 2)
    assert positions(await claim_device(store, group)) == [3]


async def test_claim_next_returns_none_for_a_stopped_group(store: EventStore, group: str) -> None:
    await store.append(DeviceReading(device_id="d1", value=0.0))
    await store.stop_group(group)
    assert await claim_device(store, group) is None
    await store.start_group(group)
    assert await claim_device(store, group) is not None


async def test_claim_next_prefers_the_partition_with_the_earliest_pending_event(
    store: EventStore, group: str
) -> None:
    await store.append(
        [
            DeviceReading(device_id="d2", value=0.0),
            DeviceReading(device_id="d1", value=0.0),
            DeviceReading(device_id="d2", value=0.0),
        ]
    )
    c = await claim_device(store, group)
    assert c is not None and c.partition_value == {"device_id": "d2"}
    await store.ack(group, c.offset_id, 1)  # d2's next pending is now 3, after d1's 2
    c2 = await claim_device(store, group, "w-2")
    assert c2 is not None and c2.partition_value == {"device_id": "d1"}


async def test_claim_next_discovers_partitions_that_appear_later(store: EventStore, group: str) -> None:
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await claim_device(store, group)
    assert c is not None
    await store.ack(group, c.offset_id, c.messages[-1].position)
    await store.append(DeviceReading(device_id="d9", value=0.0))
    later = await claim_device(store, group)
    assert later is not None and later.partition_value == {"device_id": "d9"} and positions(later) == [2]


async def test_guard_has_conditions_only_for_attributes_each_type_declares(
    store: EventStore, group: str
) -> None:
    await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"))
    c = await store.claim_next(group, partition_by="course_name", handled_types=COURSE_TYPES, worker_id="w-1")
    assert c is not None
    assert c.guard.conditions == [
        bus.QueryCondition("test.course.created", "course_name", "Algebra"),
        bus.QueryCondition("test.user.joined_course", "course_name", "Algebra"),
        bus.QueryCondition("test.course.closed", "course_name", "Algebra"),
    ]


async def test_the_claim_guard_allows_an_append_when_nothing_conflicted(
    store: EventStore, group: str
) -> None:
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await claim_device(store, group)
    assert c is not None
    await store.append(DeviceReading(device_id="d2", value=0.0))  # another partition: no conflict
    recs = await store.append(DeviceRenamed(device_id="d1", name="hall"), guard=c.guard)
    assert recs[0].position == 3


async def test_the_claim_guard_detects_a_concurrent_conflicting_write(store: EventStore, group: str) -> None:
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await claim_device(store, group)
    assert c is not None
    await store.append(DeviceReading(device_id="d1", value=9.0))  # written while the claim was processed
    with pytest.raises(bus.ConcurrentAppendError):
        await store.append(DeviceRenamed(device_id="d1", name="hall"), guard=c.guard)


# -- composite partitions: conditional AND (20-27) ------------------------------------


async def test_composite_partitions_come_only_from_events_with_every_attribute(
    store: EventStore, group: str
) -> None:
    await store.append(
        [
            CourseCreated(course_name="Algebra"),
            UserRegistered(user_id="joe", name="Joe"),
            UserJoinedCourse(course_name="Algebra", user_id="joe"),
            UserJoinedCourse(course_name="Physics", user_id="jake"),
        ]
    )
    await claim_course(store, group)
    values = sorted(tuple(sorted(c.partition_value.items())) for c in await store.partitions(group))
    assert values == [
        (("course_name", "Algebra"), ("user_id", "joe")),
        (("course_name", "Physics"), ("user_id", "jake")),
    ]


async def test_composite_fetch_includes_events_carrying_one_partition_attribute(
    store: EventStore, group: str
) -> None:
    await store.append(
        [CourseCreated(course_name="Algebra"), UserJoinedCourse(course_name="Algebra", user_id="joe")]
    )
    c = await claim_course(store, group)
    assert c is not None
    assert [m.message for m in c.messages] == [
        CourseCreated(course_name="Algebra"),
        UserJoinedCourse(course_name="Algebra", user_id="joe"),
    ]


async def test_different_composite_partitions_are_claimed_in_parallel(store: EventStore, group: str) -> None:
    await store.append(
        [
            UserJoinedCourse(course_name="Algebra", user_id="joe"),
            UserJoinedCourse(course_name="Algebra", user_id="jake"),
        ]
    )
    c1, c2 = await claim_course(store, group, "w-1"), await claim_course(store, group, "w-2")
    assert c1 is not None and c2 is not None
    assert {c1.partition_value["user_id"], c2.partition_value["user_id"]} == {"joe", "jake"}
    assert positions(c1) != positions(c2)


async def test_events_with_every_partition_attribute_must_match_every_value(
    store: EventStore, group: str
) -> None:
    await store.append(
        [
            UserJoinedCourse(course_name="Algebra", user_id="joe"),
            UserJoinedCourse(course_name="Algebra", user_id="jake"),
        ]
    )
    c = await claim_course(store, group)
    assert c is not None and c.partition_value == {"course_name": "Algebra", "user_id": "joe"}
    assert [m.message for m in c.messages] == [UserJoinedCourse(course_name="Algebra", user_id="joe")]


async def test_events_matching_every_partition_attribute_are_not_duplicated(
    store: EventStore, group: str
) -> None:
    await store.append([UserJoinedCourse(course_name="Algebra", user_id="joe")] * 2)
    assert positions(await claim_course(store, group)) == [1, 2]


async def test_events_with_a_wrong_value_for_one_attribute_are_excluded(
    store: EventStore, group: str
) -> None:
    await store.append(
        [
            UserJoinedCourse(course_name="Algebra", user_id="joe"),
            UserJoinedCourse(course_name="History", user_id="joe"),
        ]
    )
    c = await claim_course(store, group)
    assert c is not None and c.partition_value == {"course_name": "Algebra", "user_id": "joe"}
    assert positions(c) == [1]


async def test_composite_guard_conditions_follow_each_type_attributes(store: EventStore, group: str) -> None:
    await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"))
    c = await claim_course(store, group)
    assert c is not None
    assert c.guard.conditions == [
        bus.QueryCondition("test.course.created", "course_name", "Algebra"),
        bus.QueryCondition("test.user.registered", "user_id", "joe"),
        bus.QueryCondition("test.user.joined_course", "course_name", "Algebra"),
        bus.QueryCondition("test.user.joined_course", "user_id", "joe"),
        bus.QueryCondition("test.course.closed", "course_name", "Algebra"),
    ]


async def test_composite_guard_detects_a_concurrent_write_of_a_type_not_seen_yet(
    store: EventStore, group: str
) -> None:
    await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"))
    c = await claim_course(store, group)
    assert c is not None
    await store.append(CourseClosed(course_name="Algebra"))
    with pytest.raises(bus.ConcurrentAppendError):
        await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"), guard=c.guard)


async def test_the_seed_walk_through_table_of_conditional_and(store: EventStore, group: str) -> None:
    await store.append(
        [
            CourseCreated(course_name="Algebra"),  # 1: 1 attribute, matches -> yes
            UserJoinedCourse(course_name="Algebra", user_id="joe"),  # 2: both match -> yes
            UserJoinedCourse(course_name="Algebra", user_id="jake"),  # 3: 1 of 2 -> no
            CourseClosed(course_name="Algebra"),  # 4: 1 attribute, matches -> yes
            UserRegistered(user_id="joe", name="Joe"),  # 5: 1 attribute, matches -> yes
            UserJoinedCourse(course_name="History", user_id="joe"),  # 6: 1 of 2 -> no
        ]
    )
    claims = []
    while (c := await claim_course(store, group, f"w-{len(claims)}")) is not None:
        claims.append(c)
    by_partition = {
        (c.partition_value["course_name"], c.partition_value["user_id"]): positions(c) for c in claims
    }
    assert by_partition[("Algebra", "joe")] == [1, 2, 4, 5]
    assert by_partition == {
        ("Algebra", "joe"): [1, 2, 4, 5],
        ("Algebra", "jake"): [1, 3, 4],
        ("History", "joe"): [5, 6],
    }


async def test_the_seed_usage_example(store: EventStore, group: str) -> None:
    await store.append(
        [
            CourseCreated(course_name="Algebra"),
            UserRegistered(user_id="joe", name="Joe"),
            UserJoinedCourse(course_name="Algebra", user_id="joe"),
            UserJoinedCourse(course_name="Algebra", user_id="jake"),
        ]
    )
    claims = [await claim_course(store, group, "w-1"), await claim_course(store, group, "w-2")]
    joe = next(c for c in claims if c is not None and c.partition_value["user_id"] == "joe")
    assert [m.message for m in joe.messages] == [
        CourseCreated(course_name="Algebra"),
        UserRegistered(user_id="joe", name="Joe"),
        UserJoinedCourse(course_name="Algebra", user_id="joe"),
    ]
    assert joe.guard.conditions == [
        bus.QueryCondition("test.course.created", "course_name", "Algebra"),
        bus.QueryCondition("test.user.registered", "user_id", "joe"),
        bus.QueryCondition("test.user.joined_course", "course_name", "Algebra"),
        bus.QueryCondition("test.user.joined_course", "user_id", "joe"),
        bus.QueryCondition("test.course.closed", "course_name", "Algebra"),
    ]
    # Conditions are OR-ed: jake joining Algebra (position 4) is after the guard's position 3.
    with pytest.raises(bus.ConcurrentAppendError, match="position 4"):
        await store.append(CourseClosed(course_name="Algebra"), guard=joe.guard)
    await store.ack(group, offset_id=joe.offset_id, position=joe.messages[-1].position)


# -- ack / release (28-31) --------------------------------------------------------------


async def test_ack_advances_the_offset_and_releases_the_claim(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id="d1", value=0.0)] * 2)
    c = await claim_device(store, group)
    assert c is not None
    await store.ack(group, offset_id=c.offset_id, position=2)
    (cursor,) = await store.partitions(group)
    assert (cursor.position, cursor.claimed_by) == (2, None)


async def test_after_ack_the_next_claim_skips_processed_events(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id="d1", value=0.0)] * 2)
    c = await claim_device(store, group)
    assert c is not None
    await store.ack(group, c.offset_id, c.messages[-1].position)
    await store.append(DeviceReading(device_id="d1", value=1.0))
    assert positions(await claim_device(store, group, "w-2")) == [3]


async def test_release_frees_the_claim_without_advancing(store: EventStore, group: str) -> None:
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await claim_device(store, group)
    assert c is not None
    await store.release(group, offset_id=c.offset_id)
    (cursor,) = await store.partitions(group)
    assert (cursor.position, cursor.claimed_by) == (0, None)


async def test_after_release_the_same_partition_comes_back_with_the_same_events(
    store: EventStore, group: str
) -> None:
    await store.append([DeviceReading(device_id="d1", value=0.0), DeviceReading(device_id="d1", value=1.0)])
    c = await claim_device(store, group)
    assert c is not None
    await store.release(group, c.offset_id)
    again = await claim_device(store, group, "w-2")
    assert again is not None and again.offset_id == c.offset_id and again.messages == c.messages


# -- clear (32) -------------------------------------------------------------------------


async def test_clear_removes_groups_offsets_and_offset_keys(
    es_bus: bus.Bus, store: EventStore, group: str
) -> None:
    await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"))
    assert await claim_course(store, group) is not None
    other = es_bus.event_store(store.name + "-other")
    await other.register_group("kept")
    await store.clear()
    counts = await es_bus.pool.fetchrow(es_sql.COUNT_GROUP_ROWS, store.name)
    assert dict(counts) == {"groups": 0, "offsets": 0, "offset_keys": 0, "events": 0}
    assert await store.group_status(group) is None
    assert await other.group_status("kept") == "active"
    assert (await store.append(CourseCreated(course_name="x")))[0].position == 1


# -- beyond the seed: concurrency, heartbeats, stale claims, errors ----------------------------


async def test_concurrent_workers_never_hold_the_same_partition(connect: Connect) -> None:
    buses = [await connect() for _ in range(3)]
    stores = [x.event_store("devices") for x in buses]
    await stores[0].register_group("g")
    await stores[0].append([DeviceReading(device_id=f"d{i % 20}", value=float(i)) for i in range(200)])
    handled: list[int] = []

    async def worker(s: EventStore, name: str) -> None:
        while (c := await claim_device(s, "g", name)) is not None:
            handled.extend(positions(c))
            await s.ack("g", c.offset_id, c.messages[-1].position, worker_id=name)

    await asyncio.gather(*(worker(stores[i % 3], f"w-{i}") for i in range(6)))
    assert sorted(handled) == list(range(1, 201))  # each event handed out once: no partition held twice


async def test_max_messages_splits_a_partition_into_several_claims(store: EventStore, group: str) -> None:
    await store.append([DeviceReading(device_id="d1", value=float(i)) for i in range(5)])
    c = await claim_device(store, group, max_messages=2)
    assert positions(c) == [1, 2] and c is not None and c.guard.position == 2
    await store.ack(group, c.offset_id, 2)
    c = await claim_device(store, group, max_messages=2)
    assert positions(c) == [3, 4] and c is not None
    await store.ack(group, c.offset_id, 4)
    assert positions(await claim_device(store, group, max_messages=2)) == [5]


async def test_events_of_unhandled_types_do_not_produce_empty_claims(store: EventStore, group: str) -> None:
    await store.append([DeviceRenamed(device_id="d1", name="x"), DeviceReading(device_id="d2", value=0.0)])
    c = await store.claim_next(group, partition_by=DEVICE, handled_types=[DeviceReading], worker_id="w-1")
    assert c is not None and c.partition_value == {"device_id": "d2"}
    assert (
        await store.claim_next(group, partition_by=DEVICE, handled_types=[DeviceReading], worker_id="w-2")
        is None
    )


async def test_heartbeat_keeps_claims_while_stale_ones_are_released(
    es_bus: bus.Bus, store: EventStore, group: str
) -> None:
    await store.append([DeviceReading(device_id="d1", value=0.0), DeviceReading(device_id="d2", value=0.0)])
    assert await claim_device(store, group, "alive") is not None
    assert await claim_device(store, group, "silent") is not None
    clock = Clock(es_bus)
    try:
        clock.advance(60)  # no sleeping past the ttl: the clock the statements judge by moves
        assert await store.heartbeat("alive") == 1
        assert await store.release_stale_claims(ttl=30) == 1
    finally:
        clock.reset()
    holders = {c.partition_key: c.claimed_by for c in await store.partitions(group)}
    assert set(holders.values()) == {"alive", None}


async def test_an_expired_claim_moves_to_another_worker_and_the_old_ack_is_refused(connect: Connect) -> None:
    b = await connect(claim_ttl=30)
    store = b.event_store("devices")
    await store.register_group("g")
    await store.append(DeviceReading(device_id="d1", value=0.0))
    old = await claim_device(store, "g", "w-old")
    assert old is not None and await claim_device(store, "g", "w-new") is None
    Clock(b).advance(31)  # past the claim's ttl, without waiting for it
    new = await claim_device(store, "g", "w-new")
    assert new is not None and new.offset_id == old.offset_id
    with pytest.raises(bus.LeaseLostError, match="w-new"):
        await store.ack("g", old.offset_id, 1, worker_id="w-old")
    await store.ack("g", new.offset_id, 1, worker_id="w-new")


async def test_nack_retries_with_backoff_then_marks_the_group_failed(store: EventStore) -> None:
    await store.register_group("g", max_attempts=2, retry_backoff=60.0)
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await claim_device(store, "g")
    assert c is not None and c.attempts == 0
    assert await store.nack("g", c.offset_id, ValueError("boom")) is False
    assert await claim_device(store, "g") is None  # waiting for its retry_at (60 s)
    (cursor,) = await store.partitions("g")
    assert cursor.attempts == 1 and cursor.retry_at is not None and cursor.last_error == "ValueError: boom"
    await store.release_stale_claims()  # unrelated sweep leaves the retry schedule alone
    await store.nack(
        "g", c.offset_id, "still broken", retry_delay=0
    )  # an explicit delay wins over the backoff
    assert await store.group_status("g") == "failed"
    assert await claim_device(store, "g") is None
    error = await store.group_error("g")
    assert error is not None
    assert error["partition_value"] == {"device_id": "d1"} and error["attempts"] == 2
    assert error["error"] == "still broken"


async def test_start_group_resumes_a_failed_group_with_fresh_attempts(store: EventStore) -> None:
    await store.register_group("g", max_attempts=1)
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await claim_device(store, "g")
    assert c is not None
    assert await store.nack("g", c.offset_id, "boom", retry_delay=0) is True
    await store.start_group("g")
    assert await store.group_error("g") is None
    again = await claim_device(store, "g")
    assert again is not None and again.attempts == 0 and positions(again) == [1]


async def test_claim_next_on_an_unregistered_group_raises_group_not_found(store: EventStore) -> None:
    with pytest.raises(bus.GroupNotFoundError, match="register_group"):
        await claim_device(store, "nobody")


async def test_bad_claim_arguments_raise_validation_errors_and_claim_nothing(
    store: EventStore, group: str
) -> None:
    await store.append(DeviceReading(device_id="d1", value=0.0))
    with pytest.raises(bus.ValidationError, match="partition_by"):
        await store.claim_next(group, partition_by=[], handled_types=DEVICE_TYPES, worker_id="w")
    with pytest.raises(bus.ValidationError, match="attribute name"):
        await store.claim_next(group, partition_by=["a; drop"], handled_types=DEVICE_TYPES, worker_id="w")
    with pytest.raises(bus.ValidationError, match="handled_types"):
        await store.claim_next(group, partition_by=DEVICE, handled_types=[dict], worker_id="w")  # type: ignore[list-item]
    with pytest.raises(bus.ValidationError, match="no event class"):
        await store.claim_next(group, partition_by=DEVICE, handled_types=["no.such.tag"], worker_id="w")
    with pytest.raises(bus.ValidationError, match="worker id"):
        await store.claim_next(group, partition_by=DEVICE, handled_types=DEVICE_TYPES, worker_id="")
    with pytest.raises(bus.ValidationError, match="group name"):
        await store.claim_next("bad group", partition_by=DEVICE, handled_types=DEVICE_TYPES, worker_id="w")
    assert await store.partitions(group) == []


async def test_ack_of_an_unknown_partition_says_to_claim_again(store: EventStore, group: str) -> None:
    with pytest.raises(bus.ValidationError, match="claim again"):
        await store.ack(group, offset_id=999, position=1)
    with pytest.raises(bus.GroupNotFoundError):
        await store.release("nobody", offset_id=1)


async def test_handled_types_may_be_given_as_tags(store: EventStore, group: str) -> None:
    await store.append(DeviceReading(device_id="d1", value=0.0))
    c = await store.claim_next(
        group, partition_by=DEVICE, handled_types=["test.device.reading"], worker_id="w"
    )
    assert positions(c) == [1]


async def test_an_ack_from_another_process_still_leaves_nothing_pending(
    es_bus: bus.Bus, store: EventStore
) -> None:
    await store.register_group("g")
    await store.append([DeviceReading(device_id="d1", value=0.0)] * 2)
    c = await claim_device(store, "g")
    assert c is not None
    elsewhere = es_bus.event_store(store.name)  # knows nothing of the claim's fetch
    await elsewhere.ack("g", c.offset_id, c.messages[-1].position)
    assert await claim_device(elsewhere, "g") is None
    await store.append(DeviceReading(device_id="d1", value=1.0))
    assert positions(await claim_device(elsewhere, "g")) == [3]


async def test_appends_and_claims_run_on_connections_with_generic_plans(
    store: EventStore, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the default plan_cache_mode PostgreSQL re-planned a claim's read of the store on
    # every call once the store was large; the store's statements run on connections the
    # Lender lends, whose plans are generic (discovery keeps the pool's own planning).
    modes = plan_modes(monkeypatch, es_sql, "append", "claim")
    await store.append(DeviceReading(device_id="d1", value=1.0))
    claim = await claim_device(store, group)
    assert claim is not None and len(claim.messages) == 1
    assert modes == ["force_generic_plan", "force_generic_plan"]
