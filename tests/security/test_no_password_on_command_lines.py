"""No process the bus, its benchmarks or its chaos suite starts carries the server's password in its argv."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Every place that starts a child process with a DSN to hand on.
SPAWNERS = [
    "tests/chaos/harness.py",
    "benchmarks/groups.py",
    "benchmarks/compact.py",
    "tests/compaction/test_compaction_job.py",
    "tests/queues/test_queue_limits_processes.py",
    "tests/groups/test_failover.py",
    "bus/demo.py",
    "bus/compaction/spark.py",
]


def _argv_names(path: Path) -> set[str]:
    """Names of variables and attributes that appear inside argument lists of process starts."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in {
            "Popen",
            "create_subprocess_exec",
            "open_process",
            "run",
            "run_process",
            "call",
            "submit_command",
            "run_submit",
            "_spawn",
        }:
            continue
        for arg in node.args:
            for sub in ast.walk(arg):
                if isinstance(sub, ast.Name):
                    found.add(sub.id)
                elif isinstance(sub, ast.Attribute):
                    found.add(sub.attr)
    return found


def test_no_process_start_puts_a_dsn_on_the_command_line() -> None:
    for rel in SPAWNERS:
        names = _argv_names(ROOT / rel)
        assert not {n for n in names if "dsn" in n.lower()}, f"{rel} passes a DSN on a command line: {names}"
