"""CLI tables fold instead of cutting names and numbers (checked at 80 columns); `--json` for scripts;
`import bus` loads no CLI library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from rich.console import Console

import bus
from bus.tables import fit, table
from bus.testing import FAST

LONG_TOPIC = "semantics.partitioned-v2"  # 24 characters: names up to 24 always keep one line at 80 columns
LONGER_TOPIC = "payments.settlement-ledger.by-merchant-and-currency.v2"  # too long for one line at 80 columns
GROUP = "billing-settlement-consumers"


def run_cli(dsn: str, schema: str, *args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BUS_DSN": dsn, "BUS_SCHEMA": schema, "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-m", "bus", *args], env=env, capture_output=True, text=True, timeout=120
    )


async def _fill(b: bus.Bus) -> None:
    await b.create_topic(LONG_TOPIC, partitions=12, namespace="payments-namespace", task="settlement-task")
    await b.create_topic(LONGER_TOPIC, partitions=2)
    await b.create_topic("dyn", partitions=None, semantics="queue")
    await b.publish_many(LONG_TOPIC, [bus.Outgoing({"i": i}, partition=str(i % 12)) for i in range(1234)])
    await b.publish_many(LONGER_TOPIC, [bus.Outgoing({"i": i}, partition="1") for i in range(7)])


def _cell(out: str, start: str, row: str = "") -> str:
    """The cell beginning with `start` (on the row beginning with `row`), its folded pieces joined again."""
    lines = out.splitlines()
    i, at = next(
        (n, line.find(start)) for n, line in enumerate(lines) if line.startswith(row) and start in line
    )
    width = len(lines[i][at:].split()[0])
    pieces = [lines[i][at : at + width]]
    for line in lines[i + 1 :]:
        if len(pieces[-1]) < width:  # a folded cell fills its width on every line but the last
            break
        piece = line[at : at + width].strip()
        if not piece:
            break
        pieces.append(piece)
    return "".join(pieces)


@pytest.mark.slow  # runs `python -m bus` in subprocesses
async def test_topics_at_80_columns_shows_whole_names_and_numbers(
    connect: Any, dsn: str, schema: str
) -> None:
    b = await connect()
    await _fill(b)
    out = run_cli(dsn, schema, "topics")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in out.stdout
    # A name that fits stays on one line, next to its whole numbers.
    row = next(line for line in lines if LONG_TOPIC in line)
    assert row.split()[:2] == [LONG_TOPIC, "12"] and row.split()[-1] == "1234"
    # A name too long for the line is folded, never cut: every character is there, in order.
    assert LONGER_TOPIC not in out.stdout and _cell(out.stdout, LONGER_TOPIC[:12]) == LONGER_TOPIC
    assert _cell(out.stdout, "paym") in (
        "payments-namespace",
        "payments.settlement-ledger.by-merchant-and-currency.v2",
    )
    namespace_row = next(line for line in lines if line.startswith(LONG_TOPIC))
    # namespace, task, queue depth ("-" for a pubsub topic), messages
    assert namespace_row.split()[-2] == "-"
    assert _cell(out.stdout, namespace_row.split()[-4], LONG_TOPIC) == "payments-namespace"
    assert _cell(out.stdout, namespace_row.split()[-3], LONG_TOPIC) == "settlement-task"


@pytest.mark.slow  # runs `python -m bus` in subprocesses
async def test_groups_and_describe_at_80_columns_keep_names_and_numbers(
    connect: Any, dsn: str, schema: str
) -> None:
    b = await connect(**FAST)
    await _fill(b)
    async with b.consumer(GROUP, topics=[LONG_TOPIC]) as c:
        got = 0
        while got < 100:
            got += len(await c.poll(timeout=2.0))
        await c.commit()
    lag = (await b.admin.describe_group(GROUP)).total_lag

    out = run_cli(dsn, schema, "groups")
    assert out.returncode == 0, out.stderr[-2000:]
    assert max(len(line) for line in out.stdout.splitlines()) <= 80 and "…" not in out.stdout
    row = next(line for line in out.stdout.splitlines() if GROUP in line)
    assert row.split()[0] == GROUP and row.split()[-1] == str(lag)

    out = run_cli(dsn, schema, "describe", GROUP)
    assert out.returncode == 0, out.stderr[-2000:]
    assert max(len(line) for line in out.stdout.splitlines()) <= 80 and "…" not in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(LONG_TOPIC)]
    assert len(rows) == 12
    ends = {row[1]: row[3] for row in rows}  # partition -> log end offset
    assert ends == {str(p): "103" if p < 10 else "102" for p in range(12)}


@pytest.mark.slow  # runs `python -m bus` in subprocesses
async def test_json_output_of_topics_groups_and_describe(connect: Any, dsn: str, schema: str) -> None:
    b = await connect(**FAST)
    await _fill(b)
    async with b.consumer(GROUP, topics=[LONG_TOPIC]) as c:
        await c.poll(timeout=2.0)
        await c.commit()

    topics = json.loads(run_cli(dsn, schema, "topics", "--json").stdout)
    by_name = {t["name"]: t for t in topics}
    assert set(by_name) == {LONG_TOPIC, LONGER_TOPIC, "dyn"}
    assert by_name[LONG_TOPIC]["partitions"] == 12 and by_name[LONG_TOPIC]["messages"] == 1234
    assert by_name[LONG_TOPIC]["namespace"] == "payments-namespace"
    assert by_name["dyn"]["partitions"] is None and by_name["dyn"]["semantics"] == "queue"

    groups = json.loads(run_cli(dsn, schema, "groups", "--json").stdout)
    assert [g["name"] for g in groups] == [GROUP] and isinstance(groups[0]["total_lag"], int)

    d = json.loads(run_cli(dsn, schema, "describe", GROUP, "--json").stdout)
    expected = await b.admin.describe_group(GROUP)
    assert d["name"] == GROUP and d["generation"] == expected.generation
    assert d["total_lag"] == expected.total_lag and len(d["partitions"]) == 12
    assert {p["partition"]: p["end_offset"] for p in d["partitions"]} == {
        p.partition: p.end_offset for p in expected.partitions
    }

    missing = run_cli(dsn, schema, "describe", "nope", "--json")
    assert missing.returncode == 2 and "does not exist" in missing.stdout


def test_fit_folds_text_before_names_and_names_before_numbers() -> None:
    rows = [["a-name-that-is-thirty-chars-xx", "12345678", "some free text that can wrap", "x"]]
    console = Console(width=60, record=True)
    console.print(fit(table("name", "count", "note", "flag", numeric=("count",)), rows, width=60))
    out = console.export_text()
    assert max(len(line) for line in out.splitlines()) <= 60
    first = next(line for line in out.splitlines() if line.startswith("a-name"))
    assert first.split()[:2] == ["a-name-that-is-thirty-chars-xx", "12345678"]


def test_import_bus_loads_no_cli_library() -> None:
    code = (
        "import bus, sys; assert not {'rich', 'typer', 'structlog'} & set(sys.modules), sorted(sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
