"""Partition discovery: independent of the discovering call's handled types, and bounded per call."""

from __future__ import annotations

import random
from collections import defaultdict

import bus
from bus.eventstore import EventStore
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
COMPOSITE = ["course_name", "user_id"]


async def _drain(
    store: EventStore,
    group: str,
    partition_by: str | list[str],
    types: list[type[bus.Event]],
    worker: str = "w",
) -> dict[str, list[int]]:
    """Claim and ack until nothing is pending and discovery has caught up; positions per partition."""
    got: dict[str, list[int]] = defaultdict(list)
    for _ in range(10_000):
        c = await store.claim_next(group, partition_by=partition_by, handled_types=types, worker_id=worker)
        if c is None:
            if await store.discover(group, partition_by, types, budget=0) == 0:
                c = await store.claim_next(
                    group, partition_by=partition_by, handled_types=types, worker_id=worker
                )
                if c is None:
                    return dict(got)
            else:
                continue
        got[c.partition_key].extend(m.position for m in c.messages)
        await store.ack(group, c.offset_id, c.messages[-1].position)
    raise AssertionError("claims never ran out")


# -- a partition's start does not depend on who discovered it (a deploy adds a handled type) ------------


async def test_a_partition_discovered_by_a_worker_not_handling_its_events_is_pending_for_one_that_does(
    store: EventStore, group: str
) -> None:
    await store.append(
        [
            DeviceRenamed(device_id="d2", name="boiler"),  # the earliest event: only the new code handles it
            DeviceReading(device_id="d1", value=1.0),
            DeviceRenamed(device_id="d2", name="boiler-2"),
        ]
    )
    # An old worker (before the deploy) discovers both partitions and claims its own.
    old = await store.claim_next(group, partition_by=DEVICE, handled_types=[DeviceReading], worker_id="old")
    assert old is not None and old.partition_value == {DEVICE: "d1"}
    assert (
        await store.claim_next(group, partition_by=DEVICE, handled_types=[DeviceReading], worker_id="old")
        is None
    )
    # A new worker of the same group handles DeviceRenamed too: d2 is pending for it, from its first event.
    new = await store.claim_next(
        group, partition_by=DEVICE, handled_types=[DeviceReading, DeviceRenamed], worker_id="new"
    )
    assert new is not None and new.partition_value == {DEVICE: "d2"}
    assert [m.position for m in new.messages] == [1, 3]
    await store.ack(group, new.offset_id, 3)
    await store.ack(group, old.offset_id, 2)
    # Later events of the added type are found for the group too, whoever scans them.
    await store.append(DeviceRenamed(device_id="d1", name="pump"))
    assert (
        await store.claim_next(group, partition_by=DEVICE, handled_types=[DeviceReading], worker_id="old")
        is None
    )
    again = await store.claim_next(
        group, partition_by=DEVICE, handled_types=[DeviceReading, DeviceRenamed], worker_id="new"
    )
    assert again is not None and again.partition_value == {DEVICE: "d1"}
    assert [m.position for m in again.messages] == [4]


async def test_a_handled_type_added_to_a_group_later_finds_partitions_discovered_before(
    store: EventStore, group: str
) -> None:
    await store.append([DeviceReading(device_id="d1", value=1.0), DeviceRenamed(device_id="d2", name="x")])
    before = await _drain(store, group, DEVICE, [DeviceReading])
    assert before == {"device_id:d1": [1]}
    await store.append(DeviceReading(device_id="d3", value=3.0))
    # The deploy: every worker now handles DeviceRenamed too.
    after = await _drain(store, group, DEVICE, [DeviceReading, DeviceRenamed])
    assert after == {"device_id:d2": [2], "device_id:d3": [3]}


async def test_a_narrow_worker_leaves_other_types_pending_and_still_gets_its_own(
    store: EventStore, group: str
) -> None:
    await store.append([CourseClosed(course_name="Algebra")] * 3 + [CourseCreated(course_name="Physics")])
    wide = [CourseCreated, CourseClosed]
    assert (
        await store.claim_next(group, partition_by="course_name", handled_types=wide, worker_id="w")
        is not None
    )
    await store.reset_group(group)
    # The narrow worker skips Algebra (only CourseClosed pending) and claims Physics.
    narrow = await store.claim_next(
        group, partition_by="course_name", handled_types=[CourseCreated], worker_id="n"
    )
    assert narrow is not None and narrow.partition_value == {"course_name": "Physics"}
    await store.ack(group, narrow.offset_id, narrow.messages[-1].position)
    assert (
        await store.claim_next(
            group, partition_by="course_name", handled_types=[CourseCreated], worker_id="n"
        )
        is None
    )
    c = await store.claim_next(group, partition_by="course_name", handled_types=wide, worker_id="w")
    assert c is not None and c.partition_value == {"course_name": "Algebra"}
    assert [m.position for m in c.messages] == [1, 2, 3]


# -- bounded, incremental discovery ----------------------------------------------------------------------


def _random_course_log(rng: random.Random, n: int) -> list[bus.Event]:
    courses = [f"c{i}" for i in range(6)]
    users = [f"u{i}" for i in range(5)]
    events: list[bus.Event] = []
    for _ in range(n):
        kind = rng.randrange(4)
        course, user = rng.choice(courses), rng.choice(users)
        if kind == 0:
            events.append(CourseCreated(course_name=course))
        elif kind == 1:
            events.append(UserRegistered(user_id=user, name=user.upper()))
        elif kind == 2:
            events.append(UserJoinedCourse(course_name=course, user_id=user))
        else:
            events.append(CourseClosed(course_name=course))
    return events


async def test_discovery_is_bounded_per_call_and_continues_on_later_calls(
    store: EventStore, es_bus: bus.Bus
) -> None:
    await store.append([DeviceReading(device_id=f"d{i % 10}", value=float(i)) for i in range(40)])
    await store.register_group("g")
    store.discovery_batch = 3
    store.discovery_budget = 0.0
    first = await store.claim_next("g", partition_by=DEVICE, handled_types=[DeviceReading], worker_id="w")
    assert first is not None and first.partition_value == {DEVICE: "d0"}
    # One step of 3 positions: three partitions known, the rest of the log left for later calls.
    assert len(await store.partitions("g")) == 3
    assert [m.position for m in first.messages] == [1, 11, 21, 31]  # a found partition's events are all there
    await store.ack("g", first.offset_id, 31)
    calls = 1
    seen = {first.partition_key: [1, 11, 21, 31]}
    while (
        c := await store.claim_next("g", partition_by=DEVICE, handled_types=[DeviceReading], worker_id="w")
    ) or (await store.discover("g", DEVICE, [DeviceReading], budget=0) > 0):
        calls += 1
        if c is not None:
            seen.setdefault(c.partition_key, []).extend(m.position for m in c.messages)
            await store.ack("g", c.offset_id, c.messages[-1].position)
    assert calls >= 10
    assert seen == {f"device_id:d{d}": [p for p in range(1, 41) if (p - 1) % 10 == d] for d in range(10)}


async def test_incremental_discovery_delivers_exactly_what_a_full_discovery_does(
    store: EventStore, es_bus: bus.Bus
) -> None:
    rng = random.Random(7)
    await store.append(_random_course_log(rng, 60))
    await store.register_group("full")
    await store.register_group("steps")
    stepped = es_bus.event_store(store.name)
    stepped.discovery_batch = 2
    stepped.discovery_budget = 0.0
    full: dict[str, list[int]] = defaultdict(list)
    steps: dict[str, list[int]] = defaultdict(list)
    for _ in range(3):  # appends between rounds: discovery resumes where it stopped
        for key, positions in (await _drain(store, "full", COMPOSITE, COURSE_TYPES)).items():
            full[key].extend(positions)
        for key, positions in (await _drain(stepped, "steps", COMPOSITE, COURSE_TYPES)).items():
            steps[key].extend(positions)
        await store.append(_random_course_log(rng, 25))
    assert dict(steps) == dict(full)
    assert all(positions == sorted(set(positions)) for positions in steps.values())
    # CourseCreated before a partition's first UserJoinedCourse belongs to it (conditional AND).
    assert any(len(p) > 1 for p in full.values())


async def test_a_first_claim_on_a_long_log_returns_within_the_budget(
    store: EventStore, es_bus: bus.Bus
) -> None:
    await store.append([DeviceReading(device_id=f"d{i}", value=1.0) for i in range(3000)])
    await store.register_group("g")
    store.discovery_budget = 0.0  # one step of the adaptive window, not the whole log
    c = await store.claim_next("g", partition_by=DEVICE, handled_types=[DeviceReading], worker_id="w")
    assert c is not None and c.partition_value == {DEVICE: "d0"}
    assert len(await store.partitions("g")) < 3000
    assert await store.discover("g", DEVICE, [DeviceReading]) == 0
    assert len(await store.partitions("g")) == 3000
