"""The CLI says when it starts a new, empty embedded server and where; --no-start refuses; the server's
status counts the processes that use it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.embedded.helpers import private_home

# Servers of their own: one at a time, with the cores to themselves.
pytestmark = [pytest.mark.alone, pytest.mark.slow]


@pytest.fixture
def home() -> Iterator[Path]:
    with private_home() as path:
        yield path


def _bus(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "BUS_HOME": str(home), "COLUMNS": "200", **env}
    environ.pop("BUS_DSN", None)
    if "BUS_NO_START" not in env:
        environ.pop("BUS_NO_START", None)
    return subprocess.run(
        [sys.executable, "-m", "bus", *args], env=environ, capture_output=True, text=True, timeout=180
    )


async def test_no_start_refuses_to_create_a_server_and_says_where_it_looked(home: Path) -> None:
    typo = home / "typo"
    for refused in (
        await asyncio.to_thread(_bus, typo, "--no-start", "topics"),
        await asyncio.to_thread(_bus, typo, "groups", BUS_NO_START="1"),
    ):
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert str(typo) in refused.stdout and "--no-start" in refused.stdout
    assert not (typo / "pgdata").exists()  # nothing was created


async def test_a_command_that_starts_a_new_empty_server_says_so(home: Path) -> None:
    first = await asyncio.to_thread(_bus, home, "topics")
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"starting a new, empty embedded server under {home}" in first.stderr.replace("\n", " ")
    assert "BUS_NO_START" in first.stderr


_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    import bus

    async def main():
        async with bus.connect(schema="held"):
            print("ready", flush=True)
            sys.stdin.readline()

    asyncio.run(main())
    """
)


async def test_server_status_counts_the_processes_that_use_it(home: Path) -> None:
    started = await asyncio.to_thread(_bus, home, "server", "start")
    assert started.returncode == 0, started.stderr[-2000:]
    env = {**os.environ, "BUS_HOME": str(home)}
    env.pop("BUS_DSN", None)
    holder = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-c", _HOLDER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 120) == "ready\n"  # type: ignore[union-attr]
        status = await asyncio.to_thread(_bus, home, "server", "status")
        assert "1 process(es) use it" in status.stdout.replace("\n", " "), status.stdout
        # A command against the running server announces nothing.
        quiet = await asyncio.to_thread(_bus, home, "topics")
        assert quiet.returncode == 0 and "starting" not in quiet.stderr
    finally:
        holder.communicate("\n", timeout=60)
