"""The benchmark harness behind `bus bench [SCENARIO] [--quick]`.

Every scenario is a module `benchmarks/<scenario>.py` exposing
`async def run(dsn: str, quick: bool) -> list[Result]`, each row measured next
to its baseline in the same run. The harness runs the scenarios asked for (a
missing module is skipped with a note; one that raises is reported as failed
and the others still run), on `$BUS_DSN` or else the embedded server, and
writes into `benchmarks/results/`:

* `<date>.json`: every row (with its ratio) and the machine (CPUs, Python,
  PostgreSQL). Rows of scenarios not run this time are kept from an earlier
  run of the same day, so `bus bench publish` then `bus bench queue` add up;
* `<date>.md`: the table (scenario, measurement, value, unit, baseline, ratio,
  target, met?) with the machine and the charts linked;
* `<date>-throughput.png`, `<date>-latency.png`, `<date>-ratio.png`: charts;
* `latest.md`: a copy of the day's Markdown, for the README to link.

A `--quick` run (a smoke run with small sizes) writes `<date>-quick.*`
instead and leaves `latest.md` alone, so it never replaces real numbers.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from benchmarks.result import Result
from storage.logs import get_logger

log = get_logger(__name__)

SCENARIOS: tuple[str, ...] = (
    "publish",
    "groups",
    "queue",
    "worker",
    "schedule",
    "fanout",
    "claims",
    "eventstore",
    "compact",
    "soak",
    "scale",
    "xmin",
    "deadtuples",
    "imports",
    "faststream",
    "pooler",
    "failover",
    "anyio_ab",
    "stockpg",
    "workflows",
)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
LATEST = "latest.md"

# "≥ 0.8× raw", "<= 1.5x pgqueuer" (a ratio) or "≤ 32 MiB", "≥ 10000 msg/s" (the value itself).
_TARGET = re.compile(r"^\s*(≥|≤|>=|<=|>|<)\s*([0-9]+(?:\.[0-9]+)?)\s*(×|x)?")


@dataclass
class Outcome:
    """What happened to one scenario: its rows, or why there are none."""

    scenario: str
    status: str  # "ok" | "failed" | "skipped"
    seconds: float = 0.0
    note: str | None = None
    rows: list[Result] = field(default_factory=list)


def target_met(row: Result) -> bool | None:
    """Whether the row meets its target; None when it has none or the target is not machine-readable.

    A target with "×" compares the ratio (value / baseline); otherwise it
    compares the value itself, in the row's unit.
    """
    if row.target is None:
        return None
    match = _TARGET.match(row.target)
    if match is None:
        return None
    op, number, times = match.group(1), float(match.group(2)), match.group(3)
    subject = row.ratio if times else row.value
    if subject is None:
        return None
    if op in ("≥", ">="):
        return subject >= number
    if op in ("≤", "<="):
        return subject <= number
    if op == ">":
        return subject > number
    return subject < number


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}"
    return f"{value:.3g}"


def _met_text(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[met]


def _row_cells(row: Result) -> list[str]:
    ratio = row.ratio
    return [
        row.scenario,
        row.name,
        _fmt(row.value),
        row.unit,
        "-" if row.baseline is None else f"{_fmt(row.baseline)} ({row.baseline_name or 'baseline'})",
        "-" if ratio is None else f"{ratio:.2f}×",
        row.target or "-",
        _met_text(target_met(row)),
    ]


HEADER = ["scenario", "measurement", "value", "unit", "baseline", "ratio", "target", "met?"]


def _import_scenario(name: str) -> Any:
    """The scenario's module, or None when there is no such module (a module that fails to import raises)."""
    module_name = f"benchmarks.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def run_scenario(name: str, dsn: str, quick: bool) -> Outcome:
    """Run one scenario in its own event loop; never raises."""
    started = time.perf_counter()
    try:
        module = _import_scenario(name)
        if module is None:
            return Outcome(name, "skipped", note=f"no module benchmarks/{name}.py yet")
        runner = getattr(module, "run", None)
        if runner is None or not inspect.iscoroutinefunction(runner):
            return Outcome(name, "skipped", note=f"benchmarks/{name}.py has no `async def run(dsn, quick)`")
        rows = asyncio.run(runner(dsn, quick))
        bad = [r for r in rows if not isinstance(r, Result)]
        if bad:
            raise TypeError(f"run() returned {len(bad)} rows that are not benchmarks.result.Result")
        return Outcome(name, "ok", time.perf_counter() - started, rows=list(rows))
    except Exception as exc:  # a failing scenario is reported, the others still run
        log.warning("bench_scenario_failed", scenario=name, error=repr(exc))
        note = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return Outcome(name, "failed", time.perf_counter() - started, note=note)


def machine_info(dsn: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    from benchmarks.rawpeers import server_version

    try:
        postgres = asyncio.run(server_version(dsn))
    except Exception as exc:  # the scenarios will say more; the file still gets written
        postgres = f"unknown ({type(exc).__name__})"
    freq = psutil.cpu_freq()
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "cpu_mhz": None if freq is None else round(freq.max or freq.current),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "postgres": postgres,
        "commit": _git_commit(),
        # Other work on the machine moves every number; the reader should know it was there.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# -- the files ---------------------------------------------------------------------------


def _load_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    rows = data.get("rows", [])
    return rows if isinstance(rows, list) else []


def _result_from(d: dict[str, Any]) -> Result:
    fields = {k: d[k] for k in Result.__dataclass_fields__ if k in d}
    return Result(**fields)


def write_results(
    outcomes: Sequence[Outcome],
    machine: dict[str, Any],
    results_dir: Path,
    stem: str,
    *,
    quick: bool,
    update_latest: bool,
) -> dict[str, Path]:
    """Write `<stem>.json`, `<stem>.md`, the charts and (when asked) `latest.md`; returns the paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    # Two `bus bench` runs may finish at once (one per scenario): the
    # read-merge-write below must not lose the other's rows.
    with _directory_lock(results_dir):
        return _write_results(outcomes, machine, results_dir, stem, quick=quick, update_latest=update_latest)


@contextmanager
def _directory_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_results(
    outcomes: Sequence[Outcome],
    machine: dict[str, Any],
    results_dir: Path,
    stem: str,
    *,
    quick: bool,
    update_latest: bool,
) -> dict[str, Path]:
    json_path = results_dir / f"{stem}.json"
    ran = {o.scenario for o in outcomes if o.status != "skipped"}
    # Keep rows of scenarios not run now (an earlier run the same day); replace the others.
    kept = [_result_from(d) for d in _load_rows(json_path) if d.get("scenario") not in ran]
    rows = kept + [r for o in outcomes for r in o.rows]
    rows.sort(key=lambda r: (_scenario_order(r.scenario), r.scenario))
    payload = {
        "date": stem.removesuffix("-quick"),
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "machine": machine,
        "scenarios": [
            {"scenario": o.scenario, "status": o.status, "seconds": round(o.seconds, 1), "note": o.note}
            for o in outcomes
        ],
        "rows": [{**r.as_dict(), "met": target_met(r)} for r in rows],
    }
    json_path.write_text(
        json.dumps(payload, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8"
    )
    charts = write_charts(rows, results_dir, stem)
    md_path = results_dir / f"{stem}.md"
    markdown = render_markdown(rows, outcomes, machine, stem, charts, quick=quick)
    md_path.write_text(markdown, encoding="utf-8")
    paths = {"json": json_path, "md": md_path, **{f"chart:{k}": v for k, v in charts.items()}}
    if update_latest:
        latest = results_dir / LATEST
        latest.write_text(markdown, encoding="utf-8")
        paths["latest"] = latest
    return paths


def _scenario_order(name: str) -> int:
    return SCENARIOS.index(name) if name in SCENARIOS else len(SCENARIOS)


def render_markdown(
    rows: Sequence[Result],
    outcomes: Sequence[Outcome],
    machine: dict[str, Any],
    stem: str,
    charts: dict[str, Path],
    *,
    quick: bool,
) -> str:
    """The results as Markdown: the table, what did not run, the machine, the charts."""
    lines = [f"# Benchmark results, {stem.removesuffix('-quick')}{' (quick run)' if quick else ''}", ""]
    lines.append(
        "Each row is the bus next to its baseline measured in the same run on the same PostgreSQL; "
        "ratio = value / baseline (for throughput, higher is better; for latency, time and memory, lower is better)."
    )
    lines.append("")
    lines.append("| " + " | ".join(HEADER) + " |")
    lines.append("| " + " | ".join("---" for _ in HEADER) + " |")
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _row_cells(row)) + " |")
    lines.append("")
    latency = [r for r in rows if "p50" in r.extra and "p99" in r.extra]
    if latency:
        lines += [
            "Latency per call (ms):",
            "",
            "| scenario | measurement | p50 | p99 | baseline p50 | baseline p99 |",
        ]
        lines.append("| --- | --- | --- | --- | --- | --- |")
        for r in latency:
            e = r.extra
            lines.append(
                f"| {r.scenario} | {r.name} | {_fmt(e['p50'])} | {_fmt(e['p99'])} | "
                f"{_fmt(e.get('baseline_p50'))} | {_fmt(e.get('baseline_p99'))} |"
            )
        lines.append("")
    other = [o for o in outcomes if o.status != "ok"]
    if other:
        lines.append("Not measured in this run:")
        lines.append("")
        for o in other:
            lines.append(f"- `{o.scenario}`: {o.status}: {o.note or ''}".rstrip())
        lines.append("")
    lines.append(
        "Machine: {cpu} CPUs ({model}), {mem} GiB RAM, Python {py}, PostgreSQL {pg}, {plat}; commit {commit}; "
        "load average (1 min) {load_start} at start, {load_end} at end.".format(
            cpu=machine.get("cpu_count"),
            model=machine.get("cpu_model") or "unknown model",
            mem=machine.get("memory_gib"),
            py=machine.get("python"),
            pg=machine.get("postgres"),
            plat=machine.get("platform"),
            commit=machine.get("commit") or "unknown",
            load_start=machine.get("load_avg_1m_at_start", "?"),
            load_end=machine.get("load_avg_1m_at_end", "?"),
        )
    )
    lines.append("")
    for title, path in charts.items():
        lines.append(f"![{title}]({path.name})")
    # Scenarios that draw their own chart (soak, scale) name it in a row's extra.
    own = [(r.scenario, str(r.extra["chart"])) for r in rows if r.extra.get("chart")]
    for scenario, name in own:
        lines.append(f"![{scenario}]({name})")
    if charts or own:
        lines.append("")
    lines.append("Reproduce with `make bench` (or `bus bench [SCENARIO] [--quick]`).")
    lines.append("")
    return "\n".join(lines)


def write_charts(rows: Sequence[Result], results_dir: Path, stem: str) -> dict[str, Path]:
    """PNG charts: throughput by scenario, latency percentiles, ratio to baseline; returns title → path."""
    import matplotlib

    matplotlib.use("Agg")  # no display; files only
    import matplotlib.pyplot as plt

    charts: dict[str, Path] = {}

    def label(r: Result) -> str:
        return f"{r.scenario}: {r.name}"

    def save(fig: Any, suffix: str, title: str) -> None:
        path = results_dir / f"{stem}-{suffix}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        charts[title] = path

    throughput = [r for r in rows if r.unit.endswith("/s")]
    if throughput:
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * len(throughput)))
        ys = list(range(len(throughput)))
        height = 0.38
        ax.barh(
            [y - height / 2 for y in ys], [r.value for r in throughput], height, label="bus", color="#2b6cb0"
        )
        ax.barh(
            [y + height / 2 for y in ys],
            [r.baseline or 0 for r in throughput],
            height,
            label="baseline",
            color="#a0aec0",
        )
        ax.set_yticks(ys, [label(r) for r in throughput])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel(" / ".join(sorted({r.unit for r in throughput})) + " (log scale)")
        ax.set_title("Throughput by scenario (bus vs baseline)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        save(fig, "throughput", "throughput")

    latency = [r for r in rows if "p50" in r.extra and "p99" in r.extra]
    if latency:
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(latency)))
        ys = list(range(len(latency)))
        series = [
            ("bus p50", "p50", "#2b6cb0"),
            ("bus p99", "p99", "#1a365d"),
            ("baseline p50", "baseline_p50", "#cbd5e0"),
            ("baseline p99", "baseline_p99", "#718096"),
        ]
        height = 0.8 / len(series)
        for n, (name, key, color) in enumerate(series):
            values = [float(r.extra.get(key) or 0) for r in latency]
            if not any(values):
                continue
            ax.barh([y - 0.4 + height * (n + 0.5) for y in ys], values, height, label=name, color=color)
        ax.set_yticks(ys, [label(r) for r in latency])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per call (log scale)")
        ax.set_title("Latency percentiles")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        save(fig, "latency", "latency")

    ratios = [r for r in rows if r.ratio is not None]
    if ratios:
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(ratios)))
        ys = list(range(len(ratios)))
        colors = {True: "#38a169", False: "#e53e3e", None: "#718096"}
        ax.barh(ys, [r.ratio or 0 for r in ratios], 0.6, color=[colors[target_met(r)] for r in ratios])
        for y, r in zip(ys, ratios, strict=True):
            match = _TARGET.match(r.target or "")
            if match and match.group(3):
                ax.plot([float(match.group(2))] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
            ax.annotate(
                f"{r.ratio:.2f}×", (r.ratio or 0, y), xytext=(4, 0), textcoords="offset points", va="center"
            )
        ax.axvline(1.0, color="#4a5568", linestyle="--", linewidth=1)
        ax.set_yticks(ys, [label(r) for r in ratios])
        ax.invert_yaxis()
        ax.set_xlabel("value / baseline (black tick: target; green met, red missed)")
        ax.set_title("Ratio to each scenario's baseline")
        save(fig, "ratio", "ratio")
    return charts


def print_table(console: Console, rows: Sequence[Result], outcomes: Sequence[Outcome]) -> None:
    """The results table on the console."""
    table = Table(*HEADER, title="bus bench")
    for row in rows:
        cells = _row_cells(row)
        met = target_met(row)
        cells[-1] = {True: "[green]yes[/green]", False: "[red]NO[/red]", None: "-"}[met]
        table.add_row(*cells)
    console.print(table)
    for o in outcomes:
        if o.status == "skipped":
            console.print(f"[yellow]skipped[/yellow] {o.scenario}: {o.note}")
        elif o.status == "failed":
            console.print(f"[red]failed[/red] {o.scenario} after {o.seconds:.1f} s: {o.note}")


def main(
    scenario: str | None,
    quick: bool,
    console: Console,
    *,
    dsn: str | None = None,
    results_dir: Path | None = None,
    today: date | None = None,
) -> int:
    """Run `scenario` (None: all), print and write the results; 0 ok, 1 a scenario failed, 2 bad argument."""
    if scenario is not None and not re.fullmatch(r"[a-z][a-z0-9_]*", scenario):
        console.print(
            f"[red]error:[/red] unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}"
        )
        return 2
    names = [scenario] if scenario else list(SCENARIOS)
    if scenario is not None and scenario not in SCENARIOS and _import_scenario_safely(scenario) is None:
        console.print(f"[red]error:[/red] no scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
        return 2
    server = os.environ.get("BUS_BENCH_SERVER") or None
    if server is not None and server not in SERVERS:
        console.print(f"[red]error:[/red] unknown server {server!r}; choose one of {', '.join(SERVERS)}")
        return 2
    with _server(server) as started:
        return _main(names, quick, console, dsn or started, results_dir, today, server)


# Servers a run can start for itself (`bus bench --server NAME`): Debian's PostgreSQL 15 with its defaults.
SERVERS = ("pg15",)
_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@contextmanager
def _server(name: str | None) -> Iterator[str | None]:
    """The DSN of server `name`, started by its script (and stopped after, if it was not running); None: none."""
    if name is None:
        yield None
        return
    home = Path(os.environ.get("BUS_HOME", "./.bus")).resolve()
    was_running = (home / name / "data" / "postmaster.pid").is_file()
    script = str(_SCRIPTS / f"{name}.sh")
    dsn = subprocess.run([script, "start"], check=True, capture_output=True, text=True).stdout.strip()
    try:
        yield dsn
    finally:
        if not was_running:
            subprocess.run([script, "stop"], check=False, capture_output=True)


def _main(
    names: list[str],
    quick: bool,
    console: Console,
    dsn: str | None,
    results_dir: Path | None,
    today: date | None,
    server: str | None,
) -> int:
    if dsn is None:
        dsn = os.environ.get("BUS_DSN") or None
    if dsn is None:
        from bus.server.embedded import ensure_server

        dsn = ensure_server().dsn
    machine = machine_info(dsn)
    machine["load_avg_1m_at_start"] = machine.pop("load_avg_1m")
    console.print(
        f"bus bench{' --quick' if quick else ''}: {', '.join(names)} on PostgreSQL {machine['postgres']}, "
        f"{machine['cpu_count']} CPUs, Python {machine['python']}"
    )
    outcomes: list[Outcome] = []
    for name in names:
        with console.status(f"running {name}..."):
            outcome = run_scenario(name, dsn, quick)
        outcomes.append(outcome)
        log.info(
            "bench_scenario_done", scenario=name, status=outcome.status, seconds=round(outcome.seconds, 1)
        )
        if outcome.status == "ok":
            console.print(f"[green]done[/green] {name} in {outcome.seconds:.1f} s ({len(outcome.rows)} rows)")
    if hasattr(os, "getloadavg"):
        machine["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    rows = [r for o in outcomes for r in o.rows]
    print_table(console, rows, outcomes)
    # A comparison with another release, or a run on another server, is a file of its own.
    against = os.environ.get("BUS_BENCH_AGAINST")
    variant = ("-against-" + re.sub(r"[^A-Za-z0-9._-]", "_", against) if against else "") + (
        f"-{server}" if server else ""
    )
    stem = (today or date.today()).isoformat() + variant + ("-quick" if quick else "")
    target_dir = results_dir or RESULTS_DIR
    paths = write_results(
        outcomes, machine, target_dir, stem, quick=quick, update_latest=not quick and not variant
    )
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def _import_scenario_safely(name: str) -> Any:
    try:
        return _import_scenario(name)
    except Exception:  # it exists but is broken: run it, so it is reported as failed
        return True


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    raise SystemExit(main(args[0] if args else None, "--quick" in sys.argv, Console()))
