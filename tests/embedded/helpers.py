"""Helpers for tests that run embedded servers of their own."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bus.server import embedded


@contextmanager
def private_home() -> Iterator[Path]:
    """A fresh $BUS_HOME; its server is stopped and the directory removed afterwards.

    Not under pytest's tmp_path: as root the server runs as an unprivileged user
    that must traverse the path, and every pytest session makes
    /tmp/pytest-of-root private again (mode 0700) when it starts.
    """
    path = Path(tempfile.mkdtemp(prefix="bus-test-home-"))
    try:
        yield path
    finally:
        embedded.stop_server(path)
        shutil.rmtree(path, ignore_errors=True)


def wait_until_stopped(home: Path, timeout: float = 30.0) -> bool:
    """True once no server runs under `home`, its process gone too (polling); False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if embedded._running(home / "pgdata") is None and not postmasters_under(home):
            return True
        time.sleep(0.1)
    return False


def postmasters_under(root: Path) -> list[str]:
    """Command lines of postgres postmasters whose data directory is under `root`."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd and cmd[0].endswith("postgres") and "-D" in cmd:
            data = cmd[cmd.index("-D") + 1]
            if Path(data).is_relative_to(root):
                found.append(" ".join(cmd))
    return found
