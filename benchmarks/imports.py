"""`import bus`: what a process pays before it has connected anything.

Each sample is a fresh interpreter running `python -X importtime -c "import bus"`
(the cumulative time of the `bus` line: interpreter start-up is not in it);
the row is the median of the samples. The baseline, measured in the same run
the same way, is `import asyncpg`: the driver every Bus needs, so the ratio
says how much the bus adds on top of what it cannot do without.

Target: `import bus` <= 0.15 s. Consumer groups, claims, queues and the event
store load on first use, so a publisher or the pytest plugin pays for none
of them.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.result import Result

ROOT = Path(__file__).resolve().parents[1]


def _import_seconds(module: str) -> float:
    """One fresh interpreter's cumulative import time of `module` (from the checkout at ROOT)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as cwd:  # nothing in the working directory shadows the checkout
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import {module}"],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
    for line in reversed(proc.stderr.splitlines()):
        cells = line.split("|")
        if len(cells) == 3 and cells[2].strip() == module:
            return int(cells[1]) / 1e6
    raise RuntimeError(f"-X importtime printed no line for {module}")


async def run(dsn: str, quick: bool) -> list[Result]:
    runs = 5 if quick else 21
    # Interleaved, so a busy moment of the machine weighs on both alike.
    bus_times: list[float] = []
    base_times: list[float] = []
    for _ in range(runs):
        bus_times.append(await asyncio.to_thread(_import_seconds, "bus"))
        base_times.append(await asyncio.to_thread(_import_seconds, "asyncpg"))
    return [
        Result(
            "imports",
            f"import bus (median of {runs} fresh interpreters)",
            round(statistics.median(bus_times), 4),
            "s",
            baseline=round(statistics.median(base_times), 4),
            baseline_name="import asyncpg",
            higher_is_better=False,
            target="≤ 0.15 s",
            extra={"runs": runs, "min": round(min(bus_times), 4), "max": round(max(bus_times), 4)},
        )
    ]
