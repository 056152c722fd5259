"""Compaction's bookkeeping for services behind a transaction pooler.

The job holds a session (its advisory lock, Spark's JDBC connections), so it
connects to `direct_dsn`; what it records (runs, progress) is what `bus compact
--status` and the services read through the pooler.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import bus
from bus.compaction.command import compact_command
from tests.compaction.compaction_model import load

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _through_the_pooler(monkeypatch: pytest.MonkeyPatch, b: bus.Bus, direct: str | None) -> None:
    monkeypatch.setenv("BUS_DSN", b.dsn)
    monkeypatch.setenv("BUS_SCHEMA", b.config.schema)
    monkeypatch.setenv("BUS_POOLER", "transaction")
    if direct is None:
        monkeypatch.delenv("BUS_DIRECT_DSN", raising=False)
    else:
        monkeypatch.setenv("BUS_DIRECT_DSN", direct)


async def test_without_direct_dsn_bus_compact_says_what_to_set_and_runs_nothing(
    pooled: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    b = await pooled(cleaner_interval=0)
    await b.create_topic("kv", 1, cleanup="compact")
    _through_the_pooler(monkeypatch, b, None)
    console = Console(record=True, width=200, force_terminal=False)
    code = await asyncio.to_thread(compact_command, console, None, str(tmp_path / "a"), ["kv"], False)
    out = console.export_text()
    assert code != 0 and "direct_dsn" in out, out
    async with b.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM compaction_runs") == 0


async def test_a_compaction_run_is_recorded_and_seen_through_the_pooler(
    pooled: Any, dsn: str, spark: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    b = await pooled(cleaner_interval=0)
    await b.create_topic("kv", 1, cleanup="compact")
    await load(b, "kv", "0", 500, keys=10, start=datetime.now(UTC) - timedelta(days=1), step=1.0)
    _through_the_pooler(monkeypatch, b, dsn)
    console = Console(record=True, width=200, force_terminal=False)
    code = await asyncio.to_thread(compact_command, console, None, str(tmp_path / "a"), ["kv"], False)
    out = console.export_text()
    assert code == 0 and "490" in out, out  # 500 records of 10 keys: 490 removed
    console = Console(record=True, width=250, force_terminal=False)
    code = await asyncio.to_thread(compact_command, console, None, None, None, True)
    out = console.export_text()
    assert code == 0 and "done" in out and "490" in out, out
    # The services behind the pooler see the compacted log: the latest record of each key.
    got = await b.read("kv", "0", 490, 1000)  # the log now starts at the first record kept
    assert len(got) == 10 and [m.offset for m in got] == list(range(490, 500))
