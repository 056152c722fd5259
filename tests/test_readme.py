"""Every Python script in the README runs as written (each block that ends in `asyncio.run(...)`)."""

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


def _scripts() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b for b in blocks if "asyncio.run(" in b]


def test_the_readme_has_its_scripts() -> None:
    assert len(_scripts()) >= 2


@pytest.mark.parametrize("index", range(len(_scripts())))
async def test_a_readme_script_runs(dsn: str, tmp_path: Path, index: int) -> None:
    code = _scripts()[index]
    script = tmp_path / "example.py"
    script.write_text(code)
    schema = "readme_" + uuid.uuid4().hex[:8]
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema}
    try:
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        if 'describe_group("billing")' in code:
            assert "GroupDescription(name='billing'" in proc.stdout
        if "BusRouter" in code:
            assert "{'offset': 0} [7]" in proc.stdout
        if "ledger_example" in code:
            assert "ledger rows: 20" in proc.stdout
    finally:
        conn = await asyncpg.connect(dsn)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()
