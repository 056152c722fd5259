"""The embedded server's lifecycle: it stops after the last process using it, unless `bus server start` kept it.

Servers of their own under temporary homes; processes are real subprocesses,
because "the last process exits" is the thing under test (those tests are
marked slow; the in-process one is not).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from bus.server import embedded
from bus.testing import eventually
from tests.embedded.helpers import postmasters_under, private_home, wait_until_stopped

# Servers of their own, started and stopped by processes: one at a time, with the cores to themselves.
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parents[2]

# A process that uses the server the way a service does (bus.connect() with no DSN), then exits.
_USER = textwrap.dedent(
    """
    import asyncio, sys
    import bus

    async def main():
        async with bus.connect(schema="life") as b:
            await b.create_topic("t")
            await b.publish("t", b"x")
            print(b.embedded.port, flush=True)
            if len(sys.argv) > 1:
                sys.stdin.readline()  # hold on until told to exit

    asyncio.run(main())
    """
)


@pytest.fixture
def home() -> Iterator[Path]:
    with private_home() as path:
        yield path


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "BUS_HOME": str(home), "COLUMNS": "120"}
    env.pop("BUS_DSN", None)
    return env


def _bus(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bus", *args],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _use(home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _USER], env=_env(home), capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def _watchers(home: Path) -> list[int]:
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"]
        and "_watch(sys.argv[2])" in " ".join(p.info["cmdline"])
        and str(home) in p.info["cmdline"]
    ]


@pytest.mark.slow
async def test_the_server_stops_when_the_last_process_using_it_exits(home: Path) -> None:
    # A long-lived user (it waits on stdin) and a short one.
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _USER,
        "hold",
        env=_env(home),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdin is not None
    port = int((await asyncio.wait_for(holder.stdout.readline(), 120)).decode() or "0")
    assert port, (await holder.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
    short = await asyncio.to_thread(_use, home)
    assert short.returncode == 0, short.stderr[-2000:]
    assert int(short.stdout) == port  # the same server, found running

    # The short one has gone; the holder still uses the server.
    await asyncio.sleep(1.5)
    status = await asyncio.to_thread(embedded.server_status, home)
    assert status.running and status.users == 1 and not status.keep and not status.legacy
    assert len(_watchers(home)) == 1

    holder.stdin.write(b"bye\n")
    await holder.stdin.drain()
    assert await asyncio.wait_for(holder.wait(), 60) == 0
    assert await asyncio.to_thread(wait_until_stopped, home), "the server outlived its last user"
    await eventually(lambda: postmasters_under(home) == [] and _watchers(home) == [], timeout=5.0, every=0.1)


async def test_a_client_connected_by_dsn_keeps_it_up_until_it_disconnects(home: Path) -> None:
    server = await asyncio.to_thread(embedded.ensure_server, home)
    conn = await asyncpg.connect(server.dsn)
    await asyncio.to_thread(embedded.release_server, home)  # this process no longer counts as a user
    await asyncio.sleep(1.5)
    assert (await asyncio.to_thread(embedded.server_status, home)).running  # the open connection holds it
    await conn.close()
    assert await asyncio.to_thread(wait_until_stopped, home)


@pytest.mark.slow
async def test_bus_server_start_keeps_it_running_until_bus_server_stop(home: Path) -> None:
    started = await asyncio.to_thread(_bus, home, "server", "start")
    assert started.returncode == 0, started.stderr[-2000:]
    password = (home / embedded.PASSWORD_FILE).read_text().strip()
    assert "postgres:***@127.0.0.1:" in started.stdout and password not in started.stdout
    assert "until `bus server stop`" in started.stdout

    used = await asyncio.to_thread(_use, home)  # a user comes and goes
    assert used.returncode == 0, used.stderr[-2000:]
    await asyncio.sleep(1.5)
    status = json.loads((await asyncio.to_thread(_bus, home, "server", "status", "--json")).stdout)
    assert status["running"] and status["keep"] and status["users"] == 0 and not status["legacy"]
    assert password not in json.dumps(status)
    assert _watchers(home) == []

    stopped = await asyncio.to_thread(_bus, home, "server", "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert embedded._running(home / "pgdata") is None
    again = await asyncio.to_thread(_bus, home, "server", "stop")
    assert "not running" in again.stdout


@pytest.mark.slow
async def test_bus_server_start_keeps_a_server_that_is_already_running(home: Path) -> None:
    await asyncio.to_thread(embedded.ensure_server, home)
    assert (await asyncio.to_thread(_bus, home, "server", "start")).returncode == 0
    await asyncio.to_thread(embedded.release_server, home)
    await asyncio.sleep(1.5)
    status = await asyncio.to_thread(embedded.server_status, home)
    assert status.running and status.keep


_CHILD_TESTS = textwrap.dedent(
    """
    import asyncio, os
    from pathlib import Path
    import bus
    from bus.server.embedded import ensure_server

    HOMES = Path(os.environ["BUS_TEST_HOMES"])

    def test_a_server_started_and_never_stopped():
        ensure_server(HOMES / "a")

    async def test_the_embedded_default_through_connect(monkeypatch):
        monkeypatch.delenv("BUS_DSN", raising=False)
        monkeypatch.setenv("BUS_HOME", str(HOMES / "b"))
        async with bus.connect(schema="child") as b:
            await b.create_topic("t")
    """
)


@pytest.mark.slow
async def test_a_test_run_over_temporary_homes_leaves_no_server_behind(tmp_path: Path) -> None:
    with private_home() as homes:
        (tmp_path / "test_child.py").write_text(_CHILD_TESTS)
        env = {**os.environ, "BUS_TEST_HOMES": str(homes), "PYTHONPATH": str(ROOT)}
        env.pop("BUS_DSN", None)
        proc = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--rootdir",
                str(tmp_path),
                "-o",
                "asyncio_mode=auto",
                str(tmp_path / "test_child.py"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "2 passed" in proc.stdout
        for name in ("a", "b"):
            assert (homes / name / "pgdata" / "PG_VERSION").exists()
            assert await asyncio.to_thread(wait_until_stopped, homes / name), f"server {name} left running"
        await eventually(
            lambda: not (postmasters_under(homes) or _watchers(homes / "a") or _watchers(homes / "b")),
            timeout=5.0,
            every=0.1,
        )
