"""A claim_next that fails between taking a partition and reading its events leaves no claim behind.

Found by the chaos run: a connection lost right after the claim statement
left the partition claimed by a worker that never heard of it; that worker's
own heartbeats kept the claim fresh, so the partition was never handed out
again while the worker lived (its events stayed pending forever).
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

import bus
from storage import eventstore as es_sql


class Reading(bus.Event, tag="chaos.test.reading"):
    """An event with one partition attribute."""

    device: str
    value: int


async def test_a_claim_that_fails_while_fetching_is_not_left_held_by_the_worker(
    b: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = b.event_store("orphans")
    await store.register_group("g")
    await store.append([Reading(device="d1", value=1), Reading(device="d1", value=2)])
    # A real PostgreSQL error (division by zero) in place of the fetch, after the claim statement ran.
    monkeypatch.setattr(
        es_sql,
        "FETCH_PARTITION",
        "SELECT $1::text, $2::text[], $3::text[], $4::bigint, $5::text[], $6::int, 1 / 0 AS boom",
    )
    with pytest.raises(Exception, match="division by zero"):
        await store.claim_next("g", partition_by=["device"], handled_types=[Reading], worker_id="w1")
    monkeypatch.undo()
    await store.heartbeat("w1")  # the worker lives on, heartbeating its claims
    claim = await store.claim_next("g", partition_by=["device"], handled_types=[Reading], worker_id="w1")
    assert claim is not None, "the partition stayed claimed by a claim the worker never received"
    assert [e.message.value for e in claim.messages] == [1, 2]
    assert [c.claimed_by for c in await store.partitions("g")] == ["w1"]


async def test_a_claim_whose_commit_went_unanswered_is_released_before_the_workers_next_claim(
    b: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the chaos run after a PostgreSQL restart: the claim committed, its answer was lost.

    The worker never saw the claim, its heartbeats kept it fresh, and the partition's
    events stayed pending until the end of the run.
    """
    store = b.event_store("orphans")
    await store.register_group("g")
    await store.append([Reading(device="d1", value=1), Reading(device="d1", value=2)])
    real = es_sql.claim

    async def committed_but_unanswered(conn: Any, params: es_sql.ClaimParams, *, unsure: Any = None) -> Any:
        claimed = await real(conn, params, unsure=unsure)  # the claim and its fetch commit...
        assert claimed is not None
        if unsure is not None:  # the claim whose commit is not known to have been answered
            unsure[:] = [claimed.offset_id]
        raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")

    monkeypatch.setattr(es_sql, "claim", committed_but_unanswered)
    with pytest.raises(bus.errors.StorageUnavailableError):
        await store.claim_next("g", partition_by=["device"], handled_types=[Reading], worker_id="w1")
    monkeypatch.undo()
    assert [c.claimed_by for c in await store.partitions("g")] == ["w1"]  # held, unknown to the worker
    await store.heartbeat("w1")
    claim = await store.claim_next("g", partition_by=["device"], handled_types=[Reading], worker_id="w1")
    assert claim is not None, "the worker's heartbeats kept a claim it never received"
    assert [e.message.value for e in claim.messages] == [1, 2]
