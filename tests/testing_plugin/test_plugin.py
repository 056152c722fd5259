"""`bus.testing`: the pytest plugin users enable with `-p bus.testing` (also an entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import asyncpg
import pytest

import bus
from bus.testing import FAST, Clock, wait_consumed

ROOT = Path(__file__).resolve().parents[2]


def readme_plugin_example() -> str:
    """The README's plugin example: the python block of its 'Testing your handlers' section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Testing your handlers") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def run_pytest(tmp_path: Path, dsn: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `pytest -p bus.testing` on `code` as a user's project would: its own directory, no config."""
    (tmp_path / "test_user.py").write_text(code)
    env = {**os.environ, "BUS_TEST_DSN": dsn}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "bus.testing",
            "-p",
            "no:cacheprovider",
            *args,
            "test_user.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow  # two pytest processes
def test_the_readme_example_passes_and_can_fail(dsn: str, tmp_path: Path) -> None:
    code = readme_plugin_example()
    ok = run_pytest(tmp_path, dsn, code)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    assert "1 passed" in ok.stdout
    # The same test against a handler that drops an order must fail.
    broken = code.replace('await b.publish("invoices"', 'order["id"] == 3 or await b.publish("invoices"')
    assert broken != code
    bad = run_pytest(tmp_path, dsn, broken)
    assert bad.returncode == 1 and "1 failed" in bad.stdout, bad.stdout[-3000:]


@pytest.mark.slow  # a pytest process
def test_bus_client_gets_a_fresh_schema_that_is_dropped_after(dsn: str, tmp_path: Path) -> None:
    record = tmp_path / "schemas.txt"
    code = textwrap.dedent(
        f"""
        import pytest

        @pytest.mark.asyncio
        @pytest.mark.parametrize("n", [1, 2])
        async def test_schema(bus_client, n):
            assert await bus_client.list_topics() == []          # fresh: nothing from the other test
            await bus_client.create_topic("t", partitions=1)
            assert bus_client.config.heartbeat_interval == 0.2    # the fast timings
            with open({str(record)!r}, "a") as fh:
                fh.write(bus_client.config.schema + "\\n")
        """
    )
    proc = run_pytest(tmp_path, dsn, code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    schemas = record.read_text().split()
    assert len(set(schemas)) == 2

    async def existing() -> list[str]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT nspname FROM pg_namespace WHERE nspname = ANY($1::text[])", schemas
            )
            return [r["nspname"] for r in rows]
        finally:
            await conn.close()

    import asyncio

    assert asyncio.run(existing()) == []


async def test_wait_consumed_waits_for_commits(bus_client: bus.Bus) -> None:
    assert bus_client.config.session_timeout == FAST["session_timeout"]
    await bus_client.create_topic("events", partitions=2)
    await bus_client.publish_many("events", [bus.Outgoing({"n": i}) for i in range(8)])
    with pytest.raises(TimeoutError, match="has not joined yet"):
        await wait_consumed(bus_client, "late", timeout=0.3)
    async with bus_client.consumer("late", topics=["events"], auto_commit=False) as c:
        got = 0
        while got < 8:
            got += len(await c.poll(timeout=1.0))
        # polled but not committed: not consumed yet
        with pytest.raises(TimeoutError, match="is behind on events/"):
            await wait_consumed(bus_client, "late", timeout=0.3)
        await c.commit()
        d = await wait_consumed(bus_client, "late", timeout=5.0)
        assert d.total_lag == 0


async def test_bus_connect_opens_members_on_the_same_schema(bus_connect: object) -> None:
    first = await bus_connect()  # type: ignore[operator]
    second = await bus_connect()  # type: ignore[operator]
    await first.create_topic("shared", partitions=1)
    assert [t.name for t in await second.list_topics()] == ["shared"]


async def test_a_clock_moves_only_its_own_bus(bus_connect: object) -> None:
    moved = await bus_connect()  # type: ignore[operator]
    real = await bus_connect()  # type: ignore[operator]
    await moved.create_topic("jobs", partitions=1, semantics="queue")
    await moved.publish("jobs", b"x")
    async with moved.queue_consumer("jobs", visibility_timeout=30) as first:
        (job,) = await first.take(timeout=0)
        clock = Clock(moved)
        clock.advance(31)  # the job's lease has run out for `moved`'s statements only
        async with real.queue_consumer("jobs") as other:
            assert await other.take(timeout=0) == []  # real time: still leased
        async with moved.queue_consumer("jobs") as second:
            (again,) = await second.take(timeout=0)
            assert again.offset == job.offset and again.attempt == 2
            clock.reset()  # the server's clock again: the new 30-second lease holds
            async with moved.queue_consumer("jobs") as third:
                assert await third.take(timeout=0) == []
            await second.ack(again)
