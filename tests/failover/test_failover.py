"""A primary failover: a synchronous standby promoted, the old primary stopped.

Runs against scripts/pgha.sh (Debian's PostgreSQL 15); skipped without its binaries.
Every publish that returned a Record is there afterwards, and the bus (no process
restarted) publishes and delivers again.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import bus
from bus.errors import StorageUnavailableError
from bus.testing import FAST

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pgha.sh"
PG15 = Path(os.environ.get("PG15_BIN", "/usr/lib/postgresql/15/bin"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PG15 / "postgres").exists(), reason="needs PostgreSQL 15 (scripts/ensure-pg15.sh)"
    ),
]


def _pgha(home: Path, *args: str) -> str:
    env = dict(os.environ, BUS_HOME=str(home))
    out = subprocess.run(["sh", str(SCRIPT), *args], env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    home = tmp_path / "ha"
    home.mkdir()
    if os.getuid() == 0:
        shutil.chown(tmp_path, "root")
        tmp_path.chmod(0o755)
    dsn = _pgha(home, "start")
    try:
        yield home, dsn
    finally:
        _pgha(home, "stop")


async def _retry_publish(b: bus.Bus, topic: str, payload: object, deadline: float) -> bus.Record:
    while True:
        try:
            return await b.publish(topic, payload)
        except StorageUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_nothing_acknowledged_is_lost_and_the_bus_reconnects(ha: tuple[Path, str]) -> None:
    home, dsn = ha
    async with bus.connect(dsn, **FAST) as b:
        await b.create_topic("orders", partitions=4)
        delivered: list[tuple[str, int]] = []
        after_promotion = asyncio.Event()

        async def handler(m: bus.Message) -> None:
            delivered.append((m.partition, m.offset))
            if promoted_at is not None:
                after_promotion.set()

        promoted_at: float | None = None
        sub = await b.subscribe("email", handler, topics=["orders"], start="earliest")
        acked: list[bus.Record] = []
        stop = asyncio.Event()

        async def publisher(n: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    acked.append(await b.publish("orders", {"p": n, "i": i}))
                    i += 1
                except StorageUnavailableError:
                    await asyncio.sleep(0.05)  # in flight during the failover: may be retried

        publishers = [asyncio.create_task(publisher(n)) for n in range(3)]
        await asyncio.sleep(1.0)
        before = len(acked)
        assert before > 0
        _pgha(home, "stop-primary")
        await asyncio.to_thread(_pgha, home, "promote")
        promoted_at = time.monotonic()
        first = await _retry_publish(b, "orders", {"after": True}, promoted_at + 30)
        acked.append(first)
        to_publish = time.monotonic() - promoted_at
        await asyncio.wait_for(after_promotion.wait(), 30)
        to_deliver = time.monotonic() - promoted_at
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*publishers)
        await sub.stop()
        print(f"failover: first publish {to_publish:.2f} s, next delivery {to_deliver:.2f} s after promotion")
        assert len(acked) > before + 1

        seen: set[tuple[str, int]] = set()
        async with b.consumer("audit", topics=["orders"], start="earliest") as c:
            for _ in range(100):
                batch = await c.poll(timeout=0.5)
                if not batch:
                    break
                seen.update((m.partition, m.offset) for m in batch)
        missing = {(r.partition, r.offset) for r in acked} - seen
        assert not missing, f"{len(missing)} acknowledged publishes lost: {sorted(missing)[:5]}"
