"""`bus demo`: the main job, on the embedded PostgreSQL by default.

1. The log: a 12-partition topic, a few thousand messages published across
   partitions, read back, a per-partition table.
2. Consumer groups: three member processes form a group; producers keep
   publishing; one member is SIGKILLed mid-run; its partitions are taken
   over; the lag table refreshes live until the backlog is drained; a final
   check proves every acknowledged message was delivered.

Member processes run `python -m bus.demo member ...` (this module); they get
the DSN through `BUS_DSN`, not their command line, which every local user can
read. The demo ends by saying where its data is and whether the embedded
server is still running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, TypedDict

import anyio
import anyio.to_thread
from anyio.abc import Process
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

import bus
from bus.config import FAST_TIMINGS
from bus.server.embedded import EmbeddedServer, ServerStatus, mask_dsn, server_status
from bus.tables import fit, table

TOPIC = "demo.orders"
PARTITIONS = 12
TIMINGS = dict(
    heartbeat_interval=0.5, session_timeout=3.0, rebalance_delay=0.3, max_poll_interval=1.0, lease_time=10.0
)


def member_command(
    schema: str, group: str, out: Path, timings: dict[str, float], delay_ms: float
) -> list[str]:
    """The argv of one member process: it joins `group` and appends what it handles to `out`.

    The DSN is not in it: the member reads `BUS_DSN`, which other local users cannot see.
    """
    return [
        sys.executable,
        "-m",
        "bus.demo",
        "member",
        schema,
        group,
        str(out),
        str(delay_ms),
        *(f"{k}={v}" for k, v in timings.items()),
    ]


async def _member(argv: list[str]) -> None:
    schema, group, out, delay_ms, *kvs = argv
    dsn = os.environ["BUS_DSN"]
    config: dict[str, Any] = {"schema": schema, **{k: float(v) for k, v in (kv.split("=", 1) for kv in kvs)}}
    pid = os.getpid()
    pause = float(delay_ms) / 1000.0
    # Opened first: a SIGTERM that arrives while the member still connects waits in the receiver.
    with (
        anyio.open_signal_receiver(signal.SIGTERM) as signals,
        open(out, "a", buffering=1) as fh,  # noqa: ASYNC230 - a local file, written line by line
    ):

        async def handler(m: bus.Message) -> None:
            if pause:
                await asyncio.sleep(pause)
            fh.write(f"{m.partition} {m.offset} {pid}\n")

        async with bus.connect(dsn, **config) as b:
            sub = await b.subscribe(group, handler, topics=[TOPIC], batch_size=50)
            async for _ in signals:
                break
            await sub.stop()


def _deliveries(files: list[Path]) -> set[tuple[str, int]]:
    got: set[tuple[str, int]] = set()
    for f in files:
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                got.add((parts[0], int(parts[1])))
    return got


class _Killed(TypedDict, total=False):
    """The member the demo killed, and how long its partitions took to find a new owner."""

    at: float
    member: str
    partitions: list[str]
    took_over: float


def _lag_table(d: bus.GroupDescription, title: str) -> Table:
    t = table(
        "partition", "committed", "end", "lag", "owner", numeric=("committed", "end", "lag"), title=title
    )
    rows = [
        [
            p.partition,
            "-" if p.committed is None else str(p.committed),
            str(p.end_offset),
            str(p.lag),
            p.owner or "-",
        ]
        for p in d.partitions
    ]
    fit(t, rows, names=(0, 4))
    t.caption = (
        f"generation {d.generation} · state {d.state} · members {len(d.members)} · total lag {d.total_lag}"
    )
    return t


async def run_demo(console: Console, messages: int = 6000, fast: bool = False) -> bool:
    """Run the demo; True when the final check passed."""
    timings = FAST_TIMINGS if fast else TIMINGS
    group = f"demo-billing-{uuid.uuid4().hex[:6]}"
    async with bus.connect(None, **timings) as b:
        console.rule("[bold]1. The log")
        console.print(f"database: {mask_dsn(b.dsn)} · schema {b.config.schema}")
        records = await _publish_first_half(b, console, messages // 2)
        numbers = ("messages", "first offset", "last offset")
        rows = await _partition_rows(b)
        console.print(fit(table("partition", *numbers, "first key", numeric=numbers), rows, names=(0, 4)))

        console.rule("[bold]2. A consumer group of three processes, one killed mid-run")
        ok = await _group_with_a_kill(b, console, group, timings, records, messages)
        ok = await _other_modes(b, console) and ok
        dsn, schema, embedded = b.dsn, b.config.schema, b.embedded
    status = None if embedded is None else await anyio.to_thread.run_sync(server_status, embedded.home)
    console.rule("[bold]Where the data is")
    console.print(where_the_data_is(dsn, schema, embedded, status), soft_wrap=True)
    return ok


async def _publish_first_half(b: bus.Bus, console: Console, first: int) -> list[bus.Record]:
    """A fresh demo topic with `first` messages published in batches of 500."""
    try:
        await b.delete_topic(TOPIC)
    except bus.TopicNotFoundError:
        pass
    await b.create_topic(TOPIC, partitions=PARTITIONS)
    t0 = time.perf_counter()
    records: list[bus.Record] = []
    for start in range(0, first, 500):
        batch = [
            bus.Outgoing({"order": i, "amount": i % 97}, key=f"customer-{i % 50}")
            for i in range(start, min(first, start + 500))
        ]
        records += await b.publish_many(TOPIC, batch)
    elapsed = time.perf_counter() - t0
    console.print(f"published {len(records)} messages in {elapsed:.2f}s ({len(records) / elapsed:,.0f}/s)")
    return records


async def _partition_rows(b: bus.Bus) -> list[list[str]]:
    """Each partition read back: its count, first and last offset, first key."""
    rows: list[list[str]] = []
    for p in range(PARTITIONS):
        msgs: list[bus.Message] = []
        offset = 0
        while chunk := await b.read(TOPIC, partition=str(p), offset=offset, max_messages=1000):
            msgs += chunk
            offset = chunk[-1].offset + 1
        first, last = (msgs[0], msgs[-1]) if msgs else (None, None)
        rows.append(
            [
                str(p),
                str(len(msgs)),
                str(first.offset) if first else "-",
                str(last.offset) if last else "-",
                (first.key or "-") if first else "-",
            ]
        )
    return rows


async def _group_with_a_kill(
    b: bus.Bus,
    console: Console,
    group: str,
    timings: dict[str, float],
    records: list[bus.Record],
    messages: int,
) -> bool:
    """Three member processes consume while the rest is published; one is killed. True: nothing lost."""
    tmp = Path(tempfile.mkdtemp(prefix="bus-demo-"))
    files = [tmp / f"member-{i}.txt" for i in range(4)]
    for f in files:
        f.touch()
    env = {**os.environ, "BUS_DSN": b.dsn}
    procs: list[Process] = []
    try:
        for i in range(3):
            procs.append(
                await anyio.open_process(
                    member_command(b.config.schema, group, files[i], timings, 2.0),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=None,  # a member's warnings and errors reach the terminal
                    env=env,
                )
            )
        watch = _Watch(b, group, procs, list(records), first=len(records), rest=messages - len(records))
        with Live(console=console, refresh_per_second=4) as live:
            await watch.run(live, messages)
        console.print()
        return _result(console, files, watch.acked, watch.killed)
    finally:
        await stop_members(procs)


class _Watch:
    """Publishes the rest of the messages, kills a member once the group is stable, shows the lag live."""

    def __init__(
        self,
        b: bus.Bus,
        group: str,
        procs: list[Process],
        acked: list[bus.Record],
        first: int,
        rest: int,
    ) -> None:
        self.b, self.group, self.procs = b, group, procs
        self.acked, self.first, self.rest = acked, first, rest
        self.published = 0
        self.killed: _Killed = {}

    async def run(self, live: Live, messages: int) -> None:
        """Until the backlog is drained after a takeover (at most 120 s)."""
        with anyio.move_on_after(120):
            await self._until_drained(live, messages)

    async def _until_drained(self, live: Live, messages: int) -> None:
        done_at: float | None = None
        while True:
            await self._publish_some()
            try:
                d = await self.b.admin.describe_group(self.group)
            except bus.GroupNotFoundError:
                await asyncio.sleep(0.2)
                continue
            await self._maybe_kill(d)
            self._note_takeover(d)
            title = f"group {self.group} · published {len(self.acked)}/{messages}"
            live.update(Group(_lag_table(d, title), self._note()))
            if self.published >= self.rest and d.total_lag == 0 and "took_over" in self.killed:
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > 0.5:
                    return
            await asyncio.sleep(0.25)

    async def _publish_some(self) -> None:
        if self.published >= self.rest:
            return
        n = min(200, self.rest - self.published)
        base = self.first + self.published
        self.acked += await self.b.publish_many(
            TOPIC, [bus.Outgoing({"order": base + i}, key=f"customer-{i % 50}") for i in range(n)]
        )
        self.published += n

    async def _maybe_kill(self, d: bus.GroupDescription) -> None:
        """SIGKILL the first member once three own partitions, the group is stable and 600 were published."""
        owners = {p.owner for p in d.partitions if p.owner}
        if self.killed or len(owners) != 3 or d.state != "stable" or self.published < min(self.rest, 600):
            return
        victim = self.procs[0]
        member = next((m for m in d.members if m.pid == victim.pid), None)
        victim.kill()
        await victim.wait()
        self.killed = {
            "at": time.monotonic(),
            "member": member.member_id if member else "?",
            "partitions": [tp.partition for tp in member.partitions] if member else [],
        }

    def _note_takeover(self, d: bus.GroupDescription) -> None:
        """Record when every partition has an owner again and none is the killed member."""
        if not self.killed or "took_over" in self.killed:
            return
        if self.killed["member"] not in {p.owner for p in d.partitions} and all(
            p.owner for p in d.partitions
        ):
            self.killed["took_over"] = time.monotonic() - self.killed["at"]

    def _note(self) -> str:
        if not self.killed:
            return ""
        note = (
            f"killed {self.killed['member']} (pid {self.procs[0].pid}) "
            f"owning partitions {self.killed['partitions']}"
        )
        if "took_over" in self.killed:
            note += f" · taken over after {self.killed['took_over']:.1f}s"
        return note


def _result(console: Console, files: list[Path], acked: list[bus.Record], killed: _Killed) -> bool:
    """The final check: every acknowledged message was delivered, and the killed member was taken over."""
    delivered = _deliveries(files)
    missing = [(r.partition, r.offset) for r in acked if (r.partition, r.offset) not in delivered]
    console.rule("[bold]Result")
    summary = [
        ["messages acknowledged", str(len(acked))],
        ["distinct messages delivered to the group", str(len(delivered))],
        ["member killed", str(killed.get("member", "-"))],
        ["takeover time", f"{killed['took_over']:.2f}s" if "took_over" in killed else "-"],
        ["lost (acknowledged, never delivered)", str(len(missing))],
    ]
    console.print(fit(table("check", "value"), summary, names=(1,)))
    ok = not missing and "took_over" in killed
    console.print("[green]nothing lost[/green]" if ok else f"[red]FAILED[/red]: {missing[:10]}")
    return ok


async def stop_members(procs: list[Process], grace: float = 15.0) -> None:
    """SIGTERM the members still running (they leave the group), SIGKILL those not gone after `grace` s.

    Shielded: on the way out of a cancelled demo the members are still stopped, not left behind.
    """
    with anyio.CancelScope(shield=True):
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            with anyio.move_on_after(grace):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
            await proc.aclose()


def where_the_data_is(
    dsn: str, schema: str, embedded: EmbeddedServer | None, status: ServerStatus | None
) -> str:
    """The demo's last words: where its topics live and whether the server is still up (password masked).

    `status` is taken while this process still counts as one of the server's users.
    """
    if embedded is None or status is None:
        return (
            f"data: schema {schema!r} in the database at {mask_dsn(dsn)} (BUS_DSN); "
            "that server is yours: bus neither started it nor stops it"
        )
    lines = [f"data: schema {schema!r} in the embedded PostgreSQL under {embedded.pgdata}"]
    if not status.running:
        lines.append("server: not running any more")
    elif status.legacy:
        lines.append(
            "server: still running (started by an older version, never stopped automatically); "
            "`bus server stop` stops it"
        )
    elif status.keep:
        lines.append("server: still running (started with `bus server start`); `bus server stop` stops it")
    elif status.users > 1:
        lines.append(
            f"server: still running for {status.users - 1} other process(es); it stops after the last one exits"
        )
    else:
        lines.append(
            "server: stops as this command exits; the next `bus` command or `bus.connect()` starts it again "
            "(`bus server start` keeps it running)"
        )
    return "\n".join(lines)


class CourseCreated(bus.Event, tag="demo.course_created"):
    course_name: str


class UserJoinedCourse(bus.Event, tag="demo.user_joined_course"):
    course_name: str
    user_id: str


async def _other_modes(b: bus.Bus, console: Console) -> bool:
    """Claims, a queue and the event store, briefly."""
    run = uuid.uuid4().hex[:6]
    console.rule("[bold]3. Claims, a queue, the event store")
    results: list[list[str]] = []

    devices = f"demo.devices-{run}"
    await b.create_topic(devices, partitions=None)
    await b.publish_many(
        devices, [bus.Outgoing({"reading": i}, partition=f"device-{i % 20}") for i in range(400)]
    )
    taken: dict[str, int] = {}

    async def worker(name: str) -> None:
        while (
            claim := await b.claim(f"demo-readings-{run}", topic=devices, worker_id=name, max_messages=50)
        ) is not None:
            taken[name] = taken.get(name, 0) + len(claim.messages)
            await claim.ack()

    await asyncio.gather(worker("w-1"), worker("w-2"))
    results.append(
        ["claims", f"2 workers leased 20 dynamic partitions on demand: {taken} messages, nothing twice"]
    )

    jobs = f"demo.jobs-{run}"
    await b.create_topic(jobs, partitions=2, semantics="queue")
    await b.publish_many(jobs, [bus.Outgoing({"job": i}, key=f"k{i % 5}") for i in range(100)])
    done: dict[str, int] = {}

    async def consume(name: str) -> None:
        async with b.queue_consumer(jobs, visibility_timeout=10.0, max_attempts=3) as q:
            while batch := await q.take(max_messages=10, timeout=0.5):
                for job in batch:
                    await q.ack(job)
                done[name] = done.get(name, 0) + len(batch)

    await asyncio.gather(consume("c-1"), consume("c-2"))
    results.append(
        ["queue", f"2 competing consumers took and acked {sum(done.values())} of 100 jobs: {done}"]
    )

    store = b.event_store(f"demo-courses-{run}")
    await store.append(
        [CourseCreated(course_name="Algebra"), UserJoinedCourse(course_name="Algebra", user_id="joe")]
    )
    await store.register_group("enrollment")
    claim = await store.claim_next(
        "enrollment",
        partition_by=["course_name", "user_id"],
        handled_types=[CourseCreated, UserJoinedCourse],
        worker_id="w-1",
    )
    assert claim is not None
    try:
        await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"), guard=claim.guard)
        await store.append(UserJoinedCourse(course_name="Algebra", user_id="joe"), guard=claim.guard)
        guarded = "a second append with the same guard was accepted (unexpected)"
    except bus.ConcurrentAppendError:
        guarded = "a second append with the same guard raised ConcurrentAppendError"
    await store.ack("enrollment", offset_id=claim.offset_id, position=claim.messages[-1].position)
    results.append(
        [
            "event store",
            f"partition {claim.partition_value} claimed with {len(claim.messages)} events (conditional AND); {guarded}",
        ]
    )
    console.print(fit(table("mode", "what happened"), results, names=()))
    return sum(taken.values()) == 400 and sum(done.values()) == 100 and "raised" in guarded


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "member":
    asyncio.run(_member(sys.argv[2:]))
