"""The example of docs/workflows.md runs as written."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bus

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # runs the example in a process of its own
async def test_the_workflows_page_example_runs(b: bus.Bus, dsn: str, schema: str) -> None:
    text = (ROOT / "docs" / "workflows.md").read_text(encoding="utf-8")
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["{'charge': 'charge-42', 'shipment': {'carrier': 'ups'}}", "shipped"]
    info = await b.admin.workflow("order-42")
    assert [s.kind for s in info.steps] == [
        "step",
        "transaction",
        "deadline",
        "deadline",
        "wait_for",
        "event",
    ]
