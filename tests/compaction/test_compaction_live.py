"""Compaction beside live producers and a consumer group, and the `bus compact` command."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import bus
from bus.compaction import run_compaction
from bus.compaction.command import compact_command, sidecar_command
from storage.compaction import sql as compaction_sql
from tests.compaction.compaction_model import SET_COMMITTED, load, make_group

pytestmark = [pytest.mark.slow, pytest.mark.spark]


async def test_producers_and_a_group_keep_going_during_compaction_and_see_no_gap(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await b.create_topic("live", 2, cleanup="compact", tombstone_retention=3600)
    old = datetime.now(UTC) - timedelta(days=3)
    for p in ("0", "1"):
        await load(b, "live", p, 3000, keys=200, start=old, step=1.0, tombstone_every=41)
    await make_group(b, "g", ["live"], {("live", "0"): 2000, ("live", "1"): 2000})
    job = asyncio.create_task(
        asyncio.to_thread(run_compaction, b.dsn, b.config.schema, spark=spark, archive=str(tmp_path / "a"))
    )
    position = {"0": 2000, "1": 2000}
    seen: dict[str, list[int]] = {"0": [], "1": []}

    async def consume_once() -> int:
        got = 0
        for p in ("0", "1"):
            msgs = await b.read("live", partition=p, offset=position[p], max_messages=100)
            if msgs:
                seen[p].extend(m.offset for m in msgs)
                position[p] = msgs[-1].offset + 1
                async with b.pool.acquire() as conn:  # the group's commit, as a consumer would
                    await conn.execute(SET_COMMITTED, "g", "live", position[p], p)
                got += len(msgs)
        return got

    published = 0
    while not job.done():
        await b.publish("live", {"n": published}, key=f"k{published % 300}")
        published += 1
        await consume_once()
    report = await job
    while await consume_once():
        pass
    assert published > 0 and report.rows_removed > 0
    for p in ("0", "1"):
        info = await b.topic("live")
        pid = await b.partition_id(info, p, create=False)
        end = [s for s in await b.admin.topic_stats("live") if s.partition == p][0].end_offset
        assert pid is not None
        assert seen[p] == list(range(2000, end))  # dense: compaction never removed at or above the group


async def test_bus_compact_shows_a_summary_and_status_lists_the_run(
    b: bus.Bus, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await b.create_topic("kv", 1, cleanup="compact")
    await load(b, "kv", "0", 2000, keys=10, start=datetime.now(UTC) - timedelta(days=1), step=1.0)
    monkeypatch.setenv("BUS_DSN", b.dsn)
    monkeypatch.setenv("BUS_SCHEMA", b.config.schema)
    console = Console(record=True, width=200, force_terminal=False)
    code = await asyncio.to_thread(compact_command, console, None, str(tmp_path / "archive"), ["kv"], False)
    out = console.export_text()
    assert code == 0, out
    assert "compaction run 1" in out and "1990" in out  # 2000 records, 10 keys: 1990 removed
    console = Console(record=True, width=250, force_terminal=False)
    code = await asyncio.to_thread(compact_command, console, None, None, None, True)
    out = console.export_text()
    assert code == 0 and "compaction runs" in out and "done" in out and "1990" in out


async def test_the_sidecar_compacts_on_schedule_in_one_session_and_status_shows_its_outcomes(
    b: bus.Bus, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await b.create_topic("kv", 1, cleanup="compact")
    old = datetime.now(UTC) - timedelta(days=1)
    await load(b, "kv", "0", 2000, keys=10, start=old, step=1.0)
    monkeypatch.setenv("BUS_DSN", b.dsn)
    monkeypatch.setenv("BUS_SCHEMA", b.config.schema)
    console = Console(record=True, width=250, force_terminal=False)
    # Another job holds the lock: the run is recorded as busy, the sidecar goes on.
    async with b.pool.acquire() as locker:
        assert await locker.fetchval(compaction_sql.TRY_LOCK, compaction_sql.COMPACTION_LOCK_KEY)
        code = await asyncio.to_thread(
            sidecar_command, console, None, str(tmp_path / "a"), None, "1s", max_runs=1
        )
        await locker.fetchval(compaction_sql.UNLOCK, compaction_sql.COMPACTION_LOCK_KEY)
    assert code == 0
    async with b.pool.acquire() as conn:
        row = await conn.fetchrow(compaction_sql.SELECT_SIDECARS)
    assert row["last_outcome"] == "busy" and row["state"] == "stopped" and row["runs_ok"] == 0

    started = time.monotonic()
    code = await asyncio.to_thread(
        sidecar_command, console, None, str(tmp_path / "a"), None, "2s", max_runs=2
    )
    assert code == 0 and time.monotonic() - started >= 2  # the second run waited for its slot
    async with b.pool.acquire() as conn:
        rows = await conn.fetch(compaction_sql.SELECT_SIDECARS)
        runs = await conn.fetch(compaction_sql.SELECT_RUNS, 10)
    assert len(rows) == 1  # one process, one row
    assert rows[0]["runs_ok"] == 2 and rows[0]["last_outcome"] == "ok" and rows[0]["last_run_id"] == 2
    assert [r["rows_removed"] for r in runs] == [0, 1990]  # newest first: the second run found nothing new
    assert all(r["stage"] == "done" for r in runs)

    # A run that fails (an archive nobody can write) is recorded with its error; the schedule goes on.
    await load(b, "kv", "0", 100, keys=10, start=old + timedelta(hours=1), step=1.0)
    code = await asyncio.to_thread(
        sidecar_command, console, None, "nosuchfs://x/archive", None, "1s", max_runs=2
    )
    assert code == 0
    console = Console(record=True, width=400, force_terminal=False)
    assert await asyncio.to_thread(compact_command, console, None, None, None, True) == 0
    out = console.export_text()
    assert "compaction sidecars" in out and "failed" in out and "nosuchfs" in out
    assert "archive" in out  # the open run's stage: it failed in the archive step
    async with b.pool.acquire() as conn:
        row = await conn.fetchrow(compaction_sql.SELECT_SIDECARS)
    assert row["runs_failed"] == 2 and row["runs_ok"] == 2
