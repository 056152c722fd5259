"""The Spark compaction job against the real database, checked against a plain-Python model."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import bus
from bus.compaction import job, run_compaction
from bus.compaction.spark import run_submit, submit_command
from bus.testing import eventually
from tests.compaction import crashes
from tests.compaction.compaction_model import (
    LAST_RUN,
    SET_COMMITTED,
    archive_rows,
    expected_after,
    load,
    log_starts,
    make_group,
    present,
    snapshot,
)
from tests.compaction.crashes import CompactionCrash, crash_at
from tests.helpers import log_start

pytestmark = [pytest.mark.slow, pytest.mark.spark]

DAY = 86400.0


async def _history(b: bus.Bus, scale: int = 1) -> None:
    """Topics of both policies, old and young records, a group holding part of the history back.

    scale=1 is ~100,000 rows.
    """
    now = datetime.now(UTC)
    old, young = now - timedelta(days=3), now - timedelta(minutes=10)
    await b.create_topic("events", 4, cleanup="compact", tombstone_retention=3600)
    await b.create_topic("profiles", 2, cleanup="compact", retention=DAY)
    await b.create_topic("orders", 4, retention=DAY)
    await b.create_topic("audit", 2)  # delete policy, no retention: kept forever
    for p in range(4):
        await load(b, "events", str(p), 12_000 // scale, keys=500, start=old, step=1.0, tombstone_every=37)
        await load(b, "events", str(p), 1_000 // scale, keys=500, start=young, step=0.1, tombstone_every=37)
        await load(b, "orders", str(p), 8_000 // scale, keys=1000, start=old - timedelta(days=2), step=1.0)
        await load(b, "orders", str(p), 2_000 // scale, keys=1000, start=young, step=0.1)
    for p in range(2):
        await load(b, "profiles", str(p), 4_000 // scale, keys=100, start=old, step=1.0)
        await load(b, "profiles", str(p), 1_000 // scale, keys=100, start=young, step=0.1)
        await load(b, "audit", str(p), 5_000 // scale, keys=50, start=old, step=1.0)
    # The group has read part of some partitions; on "orders" 3 it has no cursor
    # moved, so it holds that partition at its log start.
    await make_group(
        b,
        "readers",
        ["events", "orders", "profiles", "audit"],
        {
            ("events", "0"): 13_000 // scale,
            ("events", "1"): 6_000 // scale,
            ("events", "2"): 13_000 // scale,
            ("events", "3"): 12_500 // scale,
            ("orders", "0"): 5_000 // scale,
            ("orders", "1"): 10_000 // scale,
            ("orders", "2"): 9_000 // scale,
            ("profiles", "0"): 5_000 // scale,
            ("profiles", "1"): 4_500 // scale,
            ("audit", "0"): 5_000 // scale,
            ("audit", "1"): 5_000 // scale,
        },
    )


async def _planned_at(b: bus.Bus) -> datetime:
    async with b.pool.acquire() as conn:
        return (await conn.fetchrow(LAST_RUN))["planned_at"]


def _compact(b: bus.Bus, spark: Any, archive: Path, **kw: Any) -> Any:
    return asyncio.to_thread(run_compaction, b.dsn, b.config.schema, spark=spark, archive=str(archive), **kw)


async def _assert_matches_model(
    b: bus.Bus, spark: Any, archive: Path, rows: list[Any], parts: list[Any]
) -> None:
    expected = expected_after(rows, parts, await _planned_at(b))
    async with b.pool.acquire() as conn:
        assert await present(conn) == expected.remaining
        assert await log_starts(conn) == expected.log_start
    got = archive_rows(spark, str(archive))
    keys = [(r["partition_id"], r["offset"]) for r in got]
    assert [k for k, n in Counter(keys).items() if n > 1] == []  # no archived row twice
    assert {(r["partition_id"], r["offset"]): r["digest"] for r in got} == expected.archived


def test_a_local_session_runs_its_python_workers_on_this_interpreter(spark: Any) -> None:
    # not the first python3 on PATH, which may lack pyspark and the bus
    ran_on = spark.sparkContext.parallelize([0], 1).map(lambda _: __import__("sys").executable).collect()
    assert ran_on == [sys.executable]


async def test_compaction_matches_the_reference_model_for_both_policies(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await _history(b)
    async with b.pool.acquire() as conn:
        rows, parts = await snapshot(conn)
    assert len(rows) >= 100_000
    report = await _compact(b, spark, tmp_path / "archive")
    await _assert_matches_model(b, spark, tmp_path / "archive", rows, parts)
    expected = expected_after(rows, parts, await _planned_at(b))
    assert report.rows_archived == report.rows_removed == len(expected.archived) > 50_000
    assert not report.resumed
    # The keep-set's bookkeeping: every keyed record in [log start, end) of a
    # compact partition was scanned; on "events" (no retention) what is kept
    # below the watermark is exactly the keep-set.
    by_id = {p["partition_id"]: p for p in parts}
    for outcome in (o for o in report.partitions if o.cleanup == "compact"):
        pid = next(
            p
            for p, row in by_id.items()
            if (row["topic"], row["partition"]) == (outcome.topic, outcome.partition)
        )
        part = by_id[pid]
        keyed = [
            r
            for r in rows
            if r["partition_id"] == pid
            and r["key"] is not None
            and part["log_start"] <= r["offset"] < part["next_offset"]
        ]
        assert outcome.scanned == len(keyed)
        if outcome.topic == "events":
            left = {o for p, o in expected.remaining if p == pid}
            assert outcome.kept == sum(
                1 for r in keyed if r["offset"] < part["low_watermark"] and r["offset"] in left
            )
    # Archive layout: partitioned by topic and date, files named by the run.
    files = [Path(f.removeprefix("file:")) for f in report.archive_files]
    assert files and all(f.name.startswith(f"run-{report.run_id}-") and f.exists() for f in files)
    assert {f.parent.parent.name for f in files} == {"topic=events", "topic=orders", "topic=profiles"}
    assert all(f.parent.name.startswith("date=") for f in files)


async def test_a_second_run_finds_nothing_more_and_archives_nothing_twice(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await _history(b, scale=10)
    first = await _compact(b, spark, tmp_path / "archive")
    second = await _compact(b, spark, tmp_path / "archive")
    assert first.rows_removed > 0
    assert second.rows_archived == second.rows_removed == 0
    got = archive_rows(spark, str(tmp_path / "archive"))
    assert len(got) == first.rows_archived


async def test_reading_below_the_log_start_after_compaction_raises_offset_out_of_range(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await _history(b, scale=10)
    await _compact(b, spark, tmp_path / "archive")
    info = await b.topic("orders")
    pid = await b.partition_id(info, "0", create=False)
    async with b.pool.acquire() as conn:
        start = (await log_starts(conn))[pid]
    assert start == 500  # the group's committed offset on orders/0 (scale 10)
    with pytest.raises(bus.OffsetOutOfRangeError):
        await b.read("orders", partition="0", offset=start - 1)
    first = await b.read("orders", partition="0", offset=start, max_messages=1)
    assert [m.offset for m in first] == [start]
    # A compact partition: the survivors keep their offsets, with gaps where records went.
    kept = await b.read("events", partition="0", offset=await log_start(b, "events", "0"), max_messages=2000)
    offsets = [m.offset for m in kept]
    assert offsets == sorted(offsets) and len(offsets) > 0
    keys = [m.key for m in kept if m.offset < 1200]
    assert len(keys) == len(set(keys))  # below the watermark at most one record per key is left


@pytest.mark.parametrize("point", ["after_archive", "mid_delete", "before_bookkeeping"])
async def test_a_run_crashed_at_any_step_finishes_like_an_uninterrupted_one(
    b: bus.Bus, spark: Any, tmp_path: Path, point: str
) -> None:
    await _history(b, scale=10)
    async with b.pool.acquire() as conn:
        rows, parts = await snapshot(conn)
    with pytest.raises(CompactionCrash):
        await _compact(b, spark, tmp_path / "archive", checkpoint=crash_at(point))
    report = await _compact(b, spark, tmp_path / "archive")
    assert report.resumed and report.attempts == 2
    await _assert_matches_model(b, spark, tmp_path / "archive", rows, parts)
    async with b.pool.acquire() as conn:
        run = await conn.fetchrow(LAST_RUN)
    assert run["status"] == "done" and run["rows_removed"] == report.rows_removed == run["rows_archived"]


async def test_a_killed_spark_submit_run_is_finished_by_the_next_run(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await _history(b, scale=10)
    async with b.pool.acquire() as conn:
        rows, parts = await snapshot(conn)
    argv, env = submit_command(
        ["--schema", b.config.schema, "--archive", str(tmp_path / "archive")],
        master="local[2]",
    )
    env["BUS_DSN"] = b.dsn  # the password through the environment, not the command line
    argv[argv.index(str(Path(job.__file__)))] = str(Path(crashes.__file__))  # the job, with a crash installed
    env["BUS_COMPACT_CRASH_AT"] = "mid_delete"
    proc = await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=240)
    # spark-submit's PythonRunner forwards the driver's stderr to its stdout.
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "injected crash at mid_delete" in output, output[-3000:]
    report = await _compact(b, spark, tmp_path / "archive")
    assert report.resumed
    await _assert_matches_model(b, spark, tmp_path / "archive", rows, parts)


async def test_a_cancelled_submit_takes_its_driver_down_and_the_next_submit_finishes_the_run(
    b: bus.Bus, tmp_path: Path
) -> None:
    await _history(b, scale=10)
    archive = tmp_path / "archive"
    args = ["--schema", b.config.schema, "--archive", str(archive)]

    def processes() -> list[psutil.Process]:
        """spark-submit's JVM and the Python driver it started: both carry the job's arguments."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmdline = p.info["cmdline"] or []
            if str(archive) in cmdline and str(Path(job.__file__)) in cmdline:
                found.append(p)
        return found

    def driver_running() -> bool:
        return any("java" not in Path(p.info["cmdline"][0]).name for p in processes())

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_submit(args, dsn=b.dsn, master="local[2]"))
        await eventually(driver_running, timeout=180, every=0.1)
        tg.cancel_scope.cancel()
    assert await eventually(lambda: processes() == [], timeout=10)  # gone with the launcher, not orphaned

    # The killed driver's lock and connections went with it: the next submit resumes or redoes the run.
    with anyio.fail_after(240):  # a hang guard
        done = await run_submit(args, dsn=b.dsn, master="local[2]")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    async with b.pool.acquire() as conn:
        run = await conn.fetchrow(LAST_RUN)
    assert run["status"] == "done" and run["rows_removed"] > 0
    assert b.dsn not in " ".join(done.args)  # the password travelled in the environment


async def test_a_group_arriving_after_planning_is_never_robbed(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await _history(b, scale=10)
    with pytest.raises(CompactionCrash):
        await _compact(b, spark, tmp_path / "archive", checkpoint=crash_at("after_archive"))
    async with b.pool.acquire() as conn:
        before = await present(conn)
        starts = await log_starts(conn)
    # A new `earliest` group on "orders" now holds every partition at its log start.
    await make_group(b, "late", ["orders"], {})
    report = await _compact(b, spark, tmp_path / "archive")
    async with b.pool.acquire() as conn:
        after = await present(conn)
        info = await b.topic("orders")
        order_ids = {await b.partition_id(info, str(p), create=False) for p in range(4)}
        assert {k for k in before if k[0] in order_ids} <= after
        now_starts = await log_starts(conn)
    assert all(now_starts[p] == starts[p] for p in order_ids)
    assert all(p.removed == 0 for p in report.partitions if p.topic == "orders")
    assert any(p.removed > 0 for p in report.partitions if p.topic == "events")
    msgs = await b.read("orders", partition="0", offset=0, max_messages=10)
    assert [m.offset for m in msgs] == list(range(10))


async def test_rows_held_back_by_a_reset_between_archive_and_delete_are_archived_once(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await _history(b, scale=10)
    async with b.pool.acquire() as conn:
        rows, parts = await snapshot(conn)
    with pytest.raises(CompactionCrash):
        await _compact(b, spark, tmp_path / "archive", checkpoint=crash_at("after_archive"))
    # An admin resets the group backwards on a delete and a compact partition
    # after the archive was written: the delete must keep those rows.
    async with b.pool.acquire() as conn:
        await conn.execute(SET_COMMITTED, "readers", "orders", 100, "0")
        await conn.execute(SET_COMMITTED, "readers", "events", 300, "0")
    held = await _compact(b, spark, tmp_path / "archive")
    assert held.resumed and held.rows_removed < held.rows_archived
    by_part = {(p.topic, p.partition): p for p in held.partitions}
    assert by_part[("orders", "0")].cut == 100 and by_part[("events", "0")].cut == 300
    # The group catches up again; the next run removes what was held back,
    # and the archive holds every removed row exactly once.
    async with b.pool.acquire() as conn:
        await conn.execute(SET_COMMITTED, "readers", "orders", 500, "0")
        await conn.execute(SET_COMMITTED, "readers", "events", 1300, "0")
    later = await _compact(b, spark, tmp_path / "archive")
    assert later.rows_removed > later.rows_archived
    assert held.rows_archived + later.rows_archived == held.rows_removed + later.rows_removed
    await _assert_matches_model(b, spark, tmp_path / "archive", rows, parts)
    async with b.pool.acquire() as conn:  # nothing held back is left to remember
        assert await conn.fetchval("SELECT count(*) FROM compaction_archived") == 0


# Test-only: rebuild this schema's `messages` as a declarative partitioned
# table by offset range (ctids per leaf), whatever layout it had before.
PARTITION_MESSAGES = """
DROP VIEW compaction_removable;
ALTER TABLE messages RENAME TO messages_plain;
CREATE TABLE messages (LIKE messages_plain INCLUDING DEFAULTS) PARTITION BY RANGE ("offset");
ALTER TABLE messages ADD CONSTRAINT messages_by_offset_pkey PRIMARY KEY (partition_id, "offset");
CREATE INDEX messages_by_offset_created ON messages (partition_id, created_at);
CREATE TABLE messages_seg0 PARTITION OF messages FOR VALUES FROM (0) TO (400);
CREATE TABLE messages_seg1 PARTITION OF messages FOR VALUES FROM (400) TO (1000);
CREATE TABLE messages_rest PARTITION OF messages DEFAULT;
INSERT INTO messages SELECT * FROM messages_plain;
DROP TABLE messages_plain;
ANALYZE messages;
"""


def _view_ddl() -> str:
    """The removable view's definition, as the latest migration creates it."""
    text = (Path(__file__).parents[2] / "storage/migrations/010_compaction_sidecar.sql").read_text()
    return text[text.index("CREATE VIEW compaction_removable") :]


async def test_a_partitioned_messages_table_compacts_like_a_plain_one(
    b: bus.Bus, spark: Any, tmp_path: Path
) -> None:
    await _history(b, scale=10)
    async with b.pool.acquire() as conn:
        await conn.execute(PARTITION_MESSAGES + _view_ddl())
        assert (
            await conn.fetchval("SELECT count(*) FROM pg_inherits WHERE inhparent = 'messages'::regclass")
            == 3
        )
        rows, parts = await snapshot(conn)
    report = await _compact(b, spark, tmp_path / "archive")
    assert report.rows_removed > 5000
    await _assert_matches_model(b, spark, tmp_path / "archive", rows, parts)
