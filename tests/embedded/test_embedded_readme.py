"""The README's embedded-server snippet runs as written (on a $BUS_HOME of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.embedded.helpers import postmasters_under, private_home

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # three `bus` processes and a server start


def _snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The embedded server") :]
    start = section.index("```sh\n") + len("```sh\n")
    return section[start : section.index("```", start)]


def test_the_readme_embedded_server_snippet_runs(tmp_path: Path) -> None:
    # `bus` is this checkout's `python -m bus` (run from the checkout), whatever an installed script points at.
    shim = tmp_path / "bin" / "bus"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m bus "$@"\n')
    shim.chmod(0o755)
    with private_home() as home:
        env = {**os.environ, "BUS_HOME": str(home), "PATH": f"{shim.parent}:{os.environ['PATH']}"}
        env.pop("BUS_DSN", None)
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", _snippet()],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        password = (home / "password").read_text().strip()
        assert "postgres:***@127.0.0.1:" in proc.stdout and password not in proc.stdout + proc.stderr
        assert "stays up until `bus server stop`" in proc.stdout and proc.stdout.rstrip().endswith("stopped")
        assert postmasters_under(home) == []
