"""docs/service.md's walkthrough runs as written and prints what the page says it prints."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "service.md"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.mark.slow  # a service's script in a subprocess
async def test_the_service_walkthrough_runs_and_prints_what_it_says(dsn: str, tmp_path: Path) -> None:
    (script,) = [b for b in _blocks("python") if "asyncio.run(" in b]
    (expected,) = _blocks("text")
    path = tmp_path / "service.py"
    path.write_text(script)
    schema = "service_" + uuid.uuid4().hex[:8]
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema}
    try:
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines() == expected.splitlines(), proc.stdout
    finally:
        conn = await asyncpg.connect(dsn)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.execute("DROP TABLE IF EXISTS public.shop_orders, public.payments")
        await conn.close()
