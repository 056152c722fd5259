"""The benchmark harness: runs scenarios, survives missing and failing ones, writes JSON, Markdown and charts.

The harness drives each scenario with `asyncio.run`, so the tests call it in a
worker thread (`asyncio.to_thread`) and keep the test loop untouched.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import types
from datetime import date
from pathlib import Path

import pytest
from rich.console import Console

from benchmarks import harness, publish
from benchmarks.result import Result

DAY = date(2031, 5, 17)


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=220, force_terminal=False), out


def _fake_scenario(monkeypatch: pytest.MonkeyPatch, name: str, rows: list[Result] | Exception) -> None:
    """Install `benchmarks.<name>` whose run() returns `rows` (or raises them)."""
    module = types.ModuleType(f"benchmarks.{name}")

    async def run(dsn: str, quick: bool) -> list[Result]:
        if isinstance(rows, Exception):
            raise rows
        return rows

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)


async def test_publish_smoke_run_writes_json_markdown_and_charts_with_ratios(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish, "QUICK", publish.Sizes(single=64, batched=2000, memory=3000, warmup=16))
    console, out = _console()

    code = await asyncio.to_thread(
        harness.main, "publish", True, console, dsn=dsn, results_dir=tmp_path, today=DAY
    )

    assert code == 0, out.getvalue()
    data = json.loads((tmp_path / "2031-05-17-quick.json").read_text(encoding="utf-8"))
    assert data["quick"] is True
    assert data["machine"]["cpu_count"] >= 1
    assert data["machine"]["python"]
    assert data["machine"]["postgres"][0].isdigit()
    throughput = {r["name"]: r for r in data["rows"] if r["unit"] == "msg/s"}
    assert set(throughput) == {
        *(
            f"publish, {n} concurrent caller{'s' if n > 1 else ''}, {p} partition{'s' if p > 1 else ''}"
            for n in (1, 8, 64)
            for p in (1, 12)
        ),
        "publish_many, 100 per call",
        "publish_many, 1000 per call",
    }
    for row in throughput.values():
        assert row["baseline_name"] == "raw asyncpg"
        assert row["value"] > 0 and row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["baseline"])
        assert row["met"] in (True, False)
        assert row["extra"]["p99"] >= row["extra"]["p50"] > 0
    memory = [r for r in data["rows"] if r["unit"] == "MiB"]
    assert {r["extra"]["messages"] for r in memory} == {3000}
    assert any(r["target"] and r["met"] is not None for r in memory)

    markdown = (tmp_path / "2031-05-17-quick.md").read_text(encoding="utf-8")
    assert "| scenario | measurement | value | unit | baseline | ratio | target | met? |" in markdown
    assert "| publish | publish_many, 1000 per call |" in markdown
    assert "× | ≥ 0.8× raw |" in markdown
    for chart in ("throughput", "latency", "ratio"):
        png = tmp_path / f"2031-05-17-quick-{chart}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in markdown
    # A quick run never replaces the real numbers the README links.
    assert not (tmp_path / "latest.md").exists()
    assert "publish_many, 100 per call" in out.getvalue()


async def test_failing_scenario_is_reported_and_the_rest_still_run(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_scenario(monkeypatch, "zz_broken", RuntimeError("the database caught fire"))
    _fake_scenario(
        monkeypatch,
        "zz_fine",
        [Result("zz_fine", "ops", 90.0, "op/s", 100.0, "raw asyncpg", target="≥ 0.8× raw")],
    )
    monkeypatch.setattr(harness, "SCENARIOS", ("zz_broken", "zz_missing", "zz_fine"))
    console, out = _console()

    code = await asyncio.to_thread(
        harness.main, None, False, console, dsn=dsn, results_dir=tmp_path, today=DAY
    )

    assert code == 1
    data = json.loads((tmp_path / "2031-05-17.json").read_text(encoding="utf-8"))
    status = {s["scenario"]: (s["status"], s["note"]) for s in data["scenarios"]}
    assert status["zz_broken"] == ("failed", "RuntimeError: the database caught fire")
    assert status["zz_missing"][0] == "skipped" and "benchmarks/zz_missing.py" in status["zz_missing"][1]
    assert status["zz_fine"][0] == "ok"
    assert [(r["scenario"], r["ratio"], r["met"]) for r in data["rows"]] == [("zz_fine", 0.9, True)]
    latest = (tmp_path / "latest.md").read_text(encoding="utf-8")
    assert latest == (tmp_path / "2031-05-17.md").read_text(encoding="utf-8")
    assert "`zz_broken`: failed: RuntimeError: the database caught fire" in latest
    assert "| zz_fine | ops | 90.0 | op/s | 100 (raw asyncpg) | 0.90× | ≥ 0.8× raw | yes |" in latest


async def test_second_run_the_same_day_keeps_rows_of_scenarios_it_did_not_run(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_scenario(
        monkeypatch, "zz_one", [Result("zz_one", "a", 1.0, "s", 2.0, "peer", higher_is_better=False)]
    )
    _fake_scenario(monkeypatch, "zz_two", [Result("zz_two", "b", 5.0, "op/s", 4.0, "peer")])
    console, _ = _console()

    assert (
        await asyncio.to_thread(
            harness.main, "zz_one", False, console, dsn=dsn, results_dir=tmp_path, today=DAY
        )
        == 0
    )
    assert (
        await asyncio.to_thread(
            harness.main, "zz_two", False, console, dsn=dsn, results_dir=tmp_path, today=DAY
        )
        == 0
    )

    data = json.loads((tmp_path / "2031-05-17.json").read_text(encoding="utf-8"))
    assert sorted((r["scenario"], r["ratio"]) for r in data["rows"]) == [("zz_one", 0.5), ("zz_two", 1.25)]


def test_unknown_scenario_is_refused_with_the_list_of_scenarios(dsn: str, tmp_path: Path) -> None:
    console, out = _console()

    code = harness.main("no_such", False, console, dsn=dsn, results_dir=tmp_path)

    assert code == 2
    assert "choose one of publish" in out.getvalue()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("target", "value", "baseline", "met"),
    [
        ("≥ 0.8× raw", 80.0, 100.0, True),
        ("≥ 0.8× raw", 79.0, 100.0, False),
        (">= 0.7x pgqueuer", 70.0, 100.0, True),
        ("≤ 1.5× raw", 1.6, 1.0, False),
        ("≤ 32 MiB", 12.0, None, True),
        ("≥ 10000 msg/s", 9000.0, None, False),
        ("flat", 1.0, None, None),
        ("≥ 0.8× raw", 1.0, None, None),
    ],
)
def test_target_is_read_as_a_ratio_with_times_sign_else_as_a_value(
    target: str, value: float, baseline: float | None, met: bool | None
) -> None:
    row = Result("s", "m", value, "u", baseline, "peer", target=target)

    assert harness.target_met(row) is met
