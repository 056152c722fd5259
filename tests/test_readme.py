"""The README's concepts example runs as written."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parents[1]


async def test_the_readme_example_runs(dsn: str, tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    script = tmp_path / "example.py"
    script.write_text(code)
    schema = "readme_" + uuid.uuid4().hex[:8]
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema}
    try:
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "GroupDescription(name='billing'" in proc.stdout
    finally:
        conn = await asyncpg.connect(dsn)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()
