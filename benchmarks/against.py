"""`bus bench publish --against REV`: this checkout's publish path next to another release's, same server.

The other release is built into a virtualenv of its own from `git archive REV`
(cached under `.bench/` at the top of the checkout, which git ignores; one
directory per commit, reused by later runs). Each measurement runs
`benchmarks/against_worker.py` under each release's interpreter in turn, the
other release first, then this checkout, for as many rounds as asked, on the
same server and with the same sizes; each side's best round is reported, with the ratios between them and to
the raw rows each worker measured in its own process (see the worker for what
it measures). Rows:

* `b.publish()` from 1×1, 8×12, 64×12 and 64×1 callers × partitions: msg/s
  against the other release (target ≥ 1.0×), and against raw one-row INSERTs;
* mixed load (400/s to a group-read topic and 400/s to a queue drained by two
  consumers, sequential publishers): publish p50 against the other release's,
  and the rate reached;
* outbox: `publish(connection=)` in a one-row transaction against the same
  transaction writing a hand-made outbox row, p50, plain and with an
  idempotency key.

Knobs (environment): BUS_BENCH_AGAINST (the release, as `--against` sets it),
BUS_BENCH_AGAINST_ROUNDS (default 2; --quick 1), BUS_BENCH_AGAINST_COUNT
(messages per concurrent measurement, default 6000), BUS_BENCH_AGAINST_SECONDS
(mixed-load seconds, default 20).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.result import Result
from storage.logs import get_logger

log = get_logger(__name__, scenario="publish")

SCENARIO = "publish"
WORKER = Path(__file__).resolve().parent / "against_worker.py"
MARK = "AGAINST-RESULT "
SHAPES = ((1, 1), (8, 12), (64, 12), (64, 1))
# Targets on the raw ratio where the release sets one (the others: no worse than the other release).
RAW_TARGETS = {(8, 12): 1.8, (64, 1): 8.0}


def checkout() -> Path:
    """The top of the git checkout the benchmarks run from."""
    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=WORKER.parent, check=True, capture_output=True, text=True
    ).stdout.strip()
    return Path(top)


def resolve(rev: str) -> str:
    """The full commit id of `rev` (a tag, branch, or abbreviated id)."""
    return subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=checkout(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def release_python(rev: str, cache: Path | None = None) -> Path:
    """The interpreter of a virtualenv holding release `rev`, built from `git archive` on first use."""
    commit = resolve(rev)
    top = checkout()
    home = (cache or top / ".bench") / f"release-{commit[:12]}"
    python = home / "venv" / "bin" / "python"
    if (home / "ready").is_file() and python.is_file():
        return python
    log.info("against_building", release=commit[:12], into=str(home))
    src = home / "src"
    subprocess.run(["rm", "-rf", str(home)], check=True)
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=top, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "venv", str(home / "venv")], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
        check=True,
        capture_output=True,
    )
    (home / "ready").write_text(commit + "\n")
    return python


def _env() -> dict[str, str]:
    # Nothing of this checkout may shadow the other release's packages.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


async def run_worker(python: Path, dsn: str, args: list[str]) -> dict[str, Any]:
    """One side's measurements: the worker under `python`, its JSON answer."""
    proc = await asyncio.create_subprocess_exec(
        str(python),
        str(WORKER),
        "--dsn",
        dsn,
        *args,
        cwd="/",
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    for line in out.decode(errors="replace").splitlines():
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK) :]))
    raise RuntimeError(
        f"the publish worker under {python} failed (exit {proc.returncode}): {err.decode(errors='replace')[-2000:]}"
    )


def _best(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measurement's best round: highest rates, lowest latencies."""
    best: dict[str, Any] = {"concurrent": {}, "mixed": None, "outbox": {}}
    for r in rounds:
        for row in r.get("concurrent", []):
            shape = (row["callers"], row["partitions"])
            held = best["concurrent"].get(shape)
            if held is None:
                best["concurrent"][shape] = dict(row)
            else:
                for k in ("rate", "raw_rate"):
                    held[k] = max(held[k], row[k])
                for k in ("p50", "raw_p50"):
                    held[k] = min(held[k], row[k])
        m = r.get("mixed")
        if m is not None:
            if best["mixed"] is None:
                best["mixed"] = dict(m)
            else:
                best["mixed"]["p50"] = min(best["mixed"]["p50"], m["p50"])
                best["mixed"]["reached"] = max(best["mixed"]["reached"], m["reached"])
        for kind, o in r.get("outbox", {}).items():
            held = best["outbox"].get(kind)
            # The ratio of one round (both p50s from the same calls), the round with the best ratio.
            if held is None or o["p50"] / o["raw_p50"] < held["p50"] / held["raw_p50"]:
                best["outbox"][kind] = dict(o)
    return best


def rows(current: dict[str, Any], other: dict[str, Any], rev: str) -> list[Result]:
    """The report: this checkout against release `rev`, and both against their raw rows."""
    results: list[Result] = []
    for shape, mine in current["concurrent"].items():
        theirs = other["concurrent"].get(shape)
        if theirs is None:
            continue
        callers, partitions = shape
        label = f"publish {callers}×{partitions} (callers × partitions)"
        extra = {
            "p50": round(mine["p50"], 3),
            "other_p50": round(theirs["p50"], 3),
            "raw_rate": round(mine["raw_rate"], 1),
            "other_raw_rate": round(theirs["raw_rate"], 1),
            "ratio_to_raw": round(mine["rate"] / mine["raw_rate"], 2),
            "other_ratio_to_raw": round(theirs["rate"] / theirs["raw_rate"], 2),
        }
        results.append(
            Result(
                SCENARIO,
                f"{label}, vs {rev}",
                round(mine["rate"], 1),
                "msg/s",
                round(theirs["rate"], 1),
                rev,
                target="≥ 1.0×",
                extra=extra,
            )
        )
        raw_target = RAW_TARGETS.get(shape)
        results.append(
            Result(
                SCENARIO,
                f"{label}, vs raw INSERT",
                round(mine["rate"], 1),
                "msg/s",
                round(mine["raw_rate"], 1),
                "raw asyncpg",
                target=None if raw_target is None else f"≥ {raw_target}×",
                extra={"other_ratio_to_raw": extra["other_ratio_to_raw"]},
            )
        )
    mine_m, theirs_m = current["mixed"], other["mixed"]
    if mine_m and theirs_m:
        results.append(
            Result(
                SCENARIO,
                f"mixed load, publish p50, vs {rev}",
                round(mine_m["p50"], 3),
                "ms",
                round(theirs_m["p50"], 3),
                rev,
                higher_is_better=False,
                target="≤ 1.0×",
                extra={
                    "offered": mine_m["offered"],
                    "reached": round(mine_m["reached"], 1),
                    "other_reached": round(theirs_m["reached"], 1),
                },
            )
        )
        results.append(
            Result(
                SCENARIO,
                f"mixed load, publish rate reached of {mine_m['offered']:g}/s offered",
                round(mine_m["reached"], 1),
                "msg/s",
                round(theirs_m["reached"], 1),
                rev,
                target=f"≥ {mine_m['offered'] * 0.99:g}",
            )
        )
    for kind, target in (("plain", 1.3), ("keyed", 1.6)):
        mine_o, theirs_o = current["outbox"].get(kind), other["outbox"].get(kind)
        if not mine_o or not theirs_o:
            continue
        label = "outbox publish(connection=)" + (", idempotency key" if kind == "keyed" else "")
        results.append(
            Result(
                SCENARIO,
                f"{label}, p50 vs a hand-made outbox row",
                round(mine_o["p50"], 3),
                "ms",
                round(mine_o["raw_p50"], 3),
                "outbox row",
                higher_is_better=False,
                target=f"≤ {target}×",
                extra={
                    "other_p50": round(theirs_o["p50"], 3),
                    "other_raw_p50": round(theirs_o["raw_p50"], 3),
                    "other_ratio": round(theirs_o["p50"] / theirs_o["raw_p50"], 2),
                },
            )
        )
        results.append(
            Result(
                SCENARIO,
                f"{label}, p50 vs {rev}",
                round(mine_o["p50"], 3),
                "ms",
                round(theirs_o["p50"], 3),
                rev,
                higher_is_better=False,
                target="≤ 1.0×",
            )
        )
    return results


async def run(dsn: str, quick: bool, rev: str | None = None) -> list[Result]:
    """Alternating rounds of the other release and this checkout; their best rounds side by side."""
    rev = rev or os.environ["BUS_BENCH_AGAINST"]
    rounds = int(os.environ.get("BUS_BENCH_AGAINST_ROUNDS", "1" if quick else "2"))
    count = int(os.environ.get("BUS_BENCH_AGAINST_COUNT", "400" if quick else "6000"))
    seconds = os.environ.get("BUS_BENCH_AGAINST_SECONDS", "2" if quick else "20")
    args = ["--count", str(count), "--outbox", "50" if quick else "1000", "--seconds", seconds]
    other_python = await asyncio.to_thread(release_python, rev)
    mine_python = Path(sys.executable)
    theirs: list[dict[str, Any]] = []
    mine: list[dict[str, Any]] = []
    # Alternation per measurement (a worker each), not per whole run: on a shared machine the
    # load moves within minutes, and a measurement's two sides should meet the same load.
    measurements = [["--what", "concurrent", "--shapes", f"{c}x{p}"] for c, p in SHAPES]
    measurements += [["--what", "outbox"], ["--what", "mixed"]]
    for what in measurements:
        for round_no in range(rounds):
            theirs.append(await run_worker(other_python, dsn, args + what))
            mine.append(await run_worker(mine_python, dsn, args + what))
            log.info("against_round", round=round_no, release=rev, other=theirs[-1], current=mine[-1])
    return rows(_best(mine), _best(theirs), rev)
