"""A rolling deploy and its rollback: the previous release (checked out from this repository's
history, see releases.json) runs beside the current code on one schema, under load, as members
of one consumer group, consumers of one queue, and claimers and appenders of one event store.
The old processes are replaced one by one, then one is rolled back. Nothing acknowledged is
lost, redelivery stays within at-least-once, and members are not fenced over and over."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import bus
from bus.testing import FAST
from storage import db
from tests.versions.rolling_worker import Enrolled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.alone,
    pytest.mark.fresh_schema,
]  # the previous release creates the schema

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("rolling_worker.py")
PREVIOUS = "0.1.0"
PHASE = 3.0  # seconds of load between two steps of the deploy
_FENCE = re.compile(r"StaleGeneration|fenc", re.IGNORECASE)


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    commit = json.loads((ROOT / "releases.json").read_text())["releases"][PREVIOUS]["commit"]
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", commit + "^{commit}"], capture_output=True
    )
    if found.returncode != 0:
        pytest.fail(
            f"release {PREVIOUS} is commit {commit} (releases.json), which this clone does not have; "
            "the rolling-deploy test runs that release from the repository's history: "
            "clone with full history (git fetch --unshallow)"
        )
    dest = tmp_path_factory.mktemp("release-" + PREVIOUS)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "bus", "actors", "storage"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


class Proc:
    """One service process on one release; its output file and log are kept for the checks."""

    def __init__(self, release: str, tree: Path, dsn: str, schema: str, tmp: Path, n: int) -> None:
        self.release, self.tree, self.name = release, tree, f"{release}#{n}"
        self.out = tmp / f"out-{n}.txt"
        self.log = tmp / f"log-{n}.txt"
        env = {**os.environ, "PYTHONPATH": str(tree), "BUS_LOG_LEVEL": "WARNING"}
        env.pop("BUS_DSN", None)
        self.p = subprocess.Popen(
            [sys.executable, str(WORKER), dsn, schema, str(self.out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
        )

    def wait_ready(self) -> None:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line.startswith("ready "), f"{self.name} did not start:\n{self.log.read_text()[-3000:]}"
        loaded = line.split(" ", 1)[1].strip()
        assert loaded.startswith(str(self.tree)), f"{self.name} loaded bus from {loaded}, not {self.tree}"

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            code = self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"{self.name} did not stop within 20 s of SIGTERM:\n{self.tail()}") from None
        assert code == 0, f"{self.name} exited with {code}:\n{self.tail()}"

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def lines(self) -> list[list[str]]:
        return [ln.split() for ln in self.out.read_text().splitlines()] if self.out.exists() else []


async def test_old_and_new_releases_share_a_group_a_queue_and_an_event_store(
    previous_tree: Path, dsn: str, schema: str, drop_schema: None, tmp_path: Path
) -> None:
    procs: list[Proc] = []

    async def start(release: str) -> Proc:
        proc = Proc(
            release, previous_tree if release == PREVIOUS else ROOT, dsn, schema, tmp_path, len(procs)
        )
        procs.append(proc)
        await asyncio.to_thread(proc.wait_ready)
        return proc

    try:
        # The previous release is deployed: it migrates the schema and creates the topics.
        old = [await start(PREVIOUS), await start(PREVIOUS)]
        published: list[bus.Record] = []
        jobs: list[bus.Record] = []
        loading = asyncio.Event()
        # The current release migrates the schema the previous one is running on.
        conn = await db.connect(dsn, schema)
        try:
            await db.migrate(conn, schema)
        except Exception as exc:
            raise AssertionError(
                f"the current release cannot migrate a schema on which release {PREVIOUS} runs "
                f"(a migration must accept the rows that release writes): {exc!r}"
            ) from exc
        finally:
            await conn.close()
        async with bus.connect(dsn, schema=schema, **FAST) as b:

            async def load() -> None:
                n = 0
                while not loading.is_set():
                    published.append(await b.publish("orders", {"n": n}, key=f"k{n % 16}"))
                    jobs.append(await b.publish("jobs", {"n": n}))
                    n += 1
                    await asyncio.sleep(0.02)

            loader = asyncio.create_task(load())
            steps = [
                ("start current #1 beside two old members (old leader)", lambda: start("current")),
                ("stop old #1", lambda: asyncio.to_thread(old[0].stop)),
                ("start current #2", lambda: start("current")),
                ("stop old #2 (current leader)", lambda: asyncio.to_thread(old[1].stop)),
                ("roll back: start old #3", lambda: start(PREVIOUS)),
                ("roll back: stop current #1", lambda: asyncio.to_thread(procs[2].stop)),
            ]
            for label, step in steps:
                await asyncio.sleep(PHASE)
                try:
                    await step()
                except AssertionError as exc:
                    raise AssertionError(f"rolling deploy step {label!r} failed: {exc}") from exc
            await asyncio.sleep(PHASE)
            loading.set()
            await loader
            for p in procs:
                (tmp_path / (p.out.name + ".quiet")).touch()

            want_g = {(r.partition, r.offset) for r in published}
            want_q = {(r.partition, r.offset) for r in jobs}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                seen = [ln for p in procs for ln in p.lines()]
                got_g = {(ln[1], int(ln[2])) for ln in seen if ln[0] == "g"}
                got_q = {(ln[1], int(ln[2])) for ln in seen if ln[0] == "q"}
                appended = {int(ln[1]) for ln in seen if ln[0] == "a"}
                handled = {int(ln[1]) for ln in seen if ln[0] == "e"}
                if want_g <= got_g and want_q <= got_q and appended <= handled:
                    break
                await asyncio.sleep(0.25)
            log_ids = {
                e.message.id for e in await b.event_store("courses").read() if isinstance(e.message, Enrolled)
            }
        for p in procs:
            if p.p.poll() is None:
                await asyncio.to_thread(p.stop)
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()

    seen = [ln for p in procs for ln in p.lines()]
    delivered = Counter((ln[1], int(ln[2])) for ln in seen if ln[0] == "g")
    acked = Counter((ln[1], int(ln[2])) for ln in seen if ln[0] == "q")
    appended = {int(ln[1]): ln[2] for ln in seen if ln[0] == "a"}
    handled = {int(ln[1]) for ln in seen if ln[0] == "e"}
    by_release = {p.name: Counter(ln[0] for ln in p.lines()) for p in procs}
    ctx = f"per process: {by_release}"

    lost_g = sorted(set((r.partition, r.offset) for r in published) - set(delivered))
    assert not lost_g, (
        f"{len(lost_g)} of {len(published)} published orders never reached the group: {lost_g[:10]}; {ctx}"
    )
    lost_q = sorted(set((r.partition, r.offset) for r in jobs) - set(acked))
    assert not lost_q, f"{len(lost_q)} of {len(jobs)} jobs never acked: {lost_q[:10]}; {ctx}"
    lost_a = sorted(p for p, ident in appended.items() if ident not in log_ids)
    assert not lost_a, f"appends returned positions {lost_a[:10]} whose events are not in the store; {ctx}"
    unhandled = sorted(set(appended) - handled)
    assert not unhandled, f"{len(unhandled)} appended events never claimed and acked: {unhandled[:10]}; {ctx}"

    # At-least-once: a partition handed over may redeliver what its old owner handled but had
    # not committed; five handovers of at most a poll interval of load each stay far below this.
    twice_g = sum(n - 1 for n in delivered.values())
    assert twice_g <= len(published) // 10, f"{twice_g} redeliveries of {len(published)} orders; {ctx}"
    twice_q = sum(n - 1 for n in acked.values())
    assert twice_q <= len(jobs) // 20, f"{twice_q} jobs acked twice of {len(jobs)}; {ctx}"

    fences = {p.name: len(_FENCE.findall(p.log.read_text())) for p in procs}
    print(
        f"rolling deploy: {len(published)} orders ({twice_g} redelivered), {len(jobs)} jobs ({twice_q} twice), "
        f"{len(appended)} events; fence lines {fences}; {ctx}"
    )
    assert sum(fences.values()) <= 20, f"fence storm: fence failures per process {fences}"
    for p in procs:
        errors = [
            ln for ln in p.log.read_text().splitlines() if ln.startswith(("ERROR", "CRITICAL", "Traceback"))
        ]
        assert not errors, f"{p.name} logged errors: {errors[:5]}\n{p.tail()}"
    # Every process, of either release, took part in every role: a member that cannot
    # join the group (or take, or claim) beside the other release shows here.
    idle = {p.name: role for p in procs for role in "gqea" if by_release[p.name][role] == 0}
    assert not idle, f"processes that never did a role (g group, q queue, e claim, a append): {idle}; {ctx}"
