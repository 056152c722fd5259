"""The guarded append's function: cached generic plans, and still a fresh look after the counter lock."""

from __future__ import annotations

import asyncio

import pytest

import bus
from bus.eventstore import EventStore
from storage import eventstore as sql
from tests.eventstore.es_events import CourseClosed, CourseCreated


async def test_the_guarded_append_runs_on_cached_generic_plans(es_bus: bus.Bus) -> None:
    # Custom plans made PL/pgSQL plan the guard check again on every call (a
    # third of the backend's CPU per append: guarded appends ran at ~0.5x).
    config = await es_bus.pool.fetchval(
        "SELECT proconfig FROM pg_proc WHERE proname = 'es_append_guarded' "
        "AND pronamespace = current_schema()::regnamespace"
    )
    assert config == ["plan_cache_mode=force_generic_plan"]


async def test_a_conflict_committed_while_the_guarded_append_waits_for_the_counter_is_seen(
    es_bus: bus.Bus, store: EventStore
) -> None:
    await store.append(CourseCreated(course_name="Algebra"))
    guard = bus.Guard(CourseClosed.to_conditions(course_name="Algebra"), 1)
    async with es_bus.pool.acquire() as holder:
        tx = holder.transaction()
        await tx.start()
        # An append in flight: it holds the store's counter until it commits.
        tags, payloads = ["test.course.closed"], ['{"course_name": "Algebra"}']
        attrs = ([1], ["course_name"], ["Algebra"], ["test.course.closed"])
        await sql.append(holder, store.name, tags, payloads, attrs)
        guarded = asyncio.create_task(store.append(CourseCreated(course_name="Algebra"), guard=guard))
        await asyncio.sleep(0.3)
        assert not guarded.done()  # waiting for the counter
        await tx.commit()
    with pytest.raises(bus.ConcurrentAppendError):
        await guarded
    assert [e.message for e in await store.read()] == [
        CourseCreated(course_name="Algebra"),
        CourseClosed(course_name="Algebra"),
    ]
