"""`bus bench publish --against REV` runs end to end at tiny sizes, against this checkout's own commit.

Numbers are not checked here (the comparison is the bench's job); the test pins that
the other release is built from `git archive` into a virtualenv of its own, that both
sides measure every row (each shape of callers × partitions, the mixed load, the
outbox row plain and keyed) and that each row sets this checkout beside the other side.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import against

pytestmark = [pytest.mark.slow, pytest.mark.alone]


async def test_publish_against_a_release_reports_every_row_beside_the_other_side(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUS_BENCH_AGAINST_COUNT", "40")
    monkeypatch.setenv("BUS_BENCH_AGAINST_SECONDS", "1")
    rows = await asyncio.to_thread(asyncio.run, against.run(dsn, True, rev="HEAD"))

    python = against.release_python("HEAD")  # built by the run, reused from the cache now
    assert python.is_file() and ".bench" in python.parts
    by_name = {r.name: r for r in rows}
    for callers, partitions in against.SHAPES:
        label = f"publish {callers}×{partitions} (callers × partitions)"
        versus = by_name[f"{label}, vs HEAD"]
        assert versus.value > 0 and versus.baseline and versus.baseline > 0 and versus.target == "≥ 1.0×"
        raw = by_name[f"{label}, vs raw INSERT"]
        assert raw.baseline_name == "raw asyncpg" and raw.baseline and raw.baseline > 0
    mixed = by_name["mixed load, publish p50, vs HEAD"]
    assert mixed.value > 0 and not mixed.higher_is_better and mixed.extra["reached"] > 0
    for kind in ("", ", idempotency key"):
        outbox = by_name[f"outbox publish(connection=){kind}, p50 vs a hand-made outbox row"]
        assert outbox.value > 0 and outbox.baseline and outbox.baseline > 0 and not outbox.higher_is_better
