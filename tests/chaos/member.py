"""A chaos member process: the loops a user writes, one per group, in one OS process.

    python -m tests.chaos.member DSN SCHEMA OUTFILE SLOW GROUP:PATTERN:ASSIGNOR[,...] [key=value config...]

(config: the Bus's settings, plus `slow_seconds=`.) One Bus per process runs
one member of each listed group, each with the loop README.md and API.md
show for its PATTERN:

- `handler`: `b.subscribe(group, handler)` (the actors commit per batch);
- `handler-dlq`: `subscribe` with `retry=bus.Retry(...)` and `dead_letter=`;
  messages whose number is `n % 31 == 7` always fail (poison: dead-lettered),
  `n % 13 == 5` fail on their first attempt only;
- `poll`: `poll()` + `commit()` after each batch, committing in `on_revoke`;
- `commit-async`: `poll()` + `c.commit_async()` (fire and forget);
- `auto`: `poll()` with `auto_commit=True`;
- `txh`: `subscribe(..., transactional=True)` with `retry=` and `dead_letter=`: the
  handler INSERTs its row on `tx.connection`, then fails like `handler-dlq`'s
  (poison always, `n % 13 == 5` on its first attempt): a failed message's row
  rolls back with its savepoint, so the table has each good message once and no
  poison at all, and the poison is dead-lettered once;
- `tx`: `async with c.transaction() as tx:` around `poll()` and the user's own
  INSERTs on `tx.connection` (exactly once in the user's table USER_TABLE);
- `txlow`: the user's own transaction, INSERTs, `commit(connection=conn)`,
  and `await c.rewind()` when anything raised (exactly once too);
- `claims`: `b.claim` then `ack()`, a partial `ack(offset)`, `release()`, or
  work past the lease then `extend()` (LeaseLostError expected when another
  worker took it; a later `ack()` must raise too);
- `queue`: `queue_consumer` `take`, `ack` / `ack_many`, `nack` (poison
  `n % 31 == 7` always: dead letters; `n % 7 == 3` once), and jobs abandoned on
  their first attempt (`n % 11 == 4`: the visibility timeout brings them back);
- `es`: event-store `claim_next`, a guarded `append` of a Tally covering the
  claimed Items, `ack` (a guard conflict: `release` and claim again);
- `lqueue`: `queue_consumer` on LQUEUE, a queue with `max_in_flight_per_key`
  and `rate_limit` whose producer publishes keyed, delayed and prioritized jobs
  (`limited_job`) and a schedule publishes a tick every second: `take`, some
  work per job, `ack` one job at a time (`n % 9 == 2` nacked once). Its takes
  and acks are recorded with their own timestamps ("J", "Y" lines).

The tx patterns hold their transaction open a little (the user's work), so
rebalances land while it is open.

Lines appended to OUTFILE, flushed per line (a SIGKILL loses nothing written):

    D group topic partition offset msg_id pid member generation time   a message handled
    K group topic partition offset msg_id pid generation time          a user ack that returned (claims, queue, es)
    N group kind                                                       a pattern event to count (released, nacked, ...)
    V time event detail                                                a library event or a pattern event that re-delivers
    E time kind message                                                an error the member saw (it goes on)
    B time text                                                        a contract breach the member saw
    S start|end time                                                   a slow-handler stall
    J group topic partition offset msg_id key asked got               a limited queue's job taken (take called, returned)
    Y group topic partition offset acked_from                          its ack returned (called at acked_from)

For claims `generation` is the lease epoch, for queue jobs the attempt, for
event-store claims the cursor id. SLOW "1": SIGUSR1 makes the next handled
message block the whole process (time.sleep, heartbeats included) for
`slow_seconds`, longer than the lease. SIGTERM stops the member gracefully.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import sys
import time
from typing import Any, TextIO

import msgspec
import structlog

import bus

TOPIC = "orders"
QUEUE = "jobs"
STORE = "chaos-es"
USER_TABLE = "user_rows"
INSERT_ROW = (
    "INSERT INTO {schema}.user_rows (grp, topic, part, off, msg_id, pid, member, t) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
CREATE_USER_TABLE = (
    "CREATE TABLE IF NOT EXISTS {schema}.user_rows (grp text, topic text, part text, off bigint, msg_id text, "
    "pid int, member text, t double precision)"  # no unique key on purpose: a duplicate must show
)
RETRY = bus.Retry(max_attempts=3, backoff=0.05)
QUEUE_MAX_ATTEMPTS = 5
QUEUE_VISIBILITY = 2.0
CLAIM_LEASE = 2.0
# The limited queue: its limits, what its consumers take at once, its schedule (a tick a second).
LQUEUE = "ljobs"
LQUEUE_PER_KEY = 2
LQUEUE_RATE = bus.Rate(12, per=1.0)
LQUEUE_VISIBILITY = 2.0
LQUEUE_MAX_ATTEMPTS = 50  # no job of it is dead-lettered: every one must be acked
LQUEUE_TAKE = 5
SCHEDULE = "chaos-tick"
SCHEDULE_CRON = "* * * * * *"
SCHEDULE_EVERY = 1.0


def limited_job(n: int) -> tuple[str, float | None, int | None]:
    """(key, delay in seconds, priority) of the limited queue's n-th job."""
    return f"k{n % 4}", 0.5 if n % 4 == 1 else None, (n % 3) - 1 or None


def number(msg_id: str) -> int:
    """The producer's sequence number in a message id ("p-17" -> 17)."""
    return int(msg_id.rsplit("-", 1)[1])


def poison(msg_id: str) -> bool:
    """Messages every handler attempt fails on (dead-lettered by handler-dlq and queue)."""
    return number(msg_id) % 31 == 7


class Item(bus.Event, tag="chaos.item"):
    """An event-store event the producer appends; partitioned by account."""

    account: str
    id: str


class Tally(bus.Event, tag="chaos.tally"):
    """What an event-store worker appends (guarded) for the Items of one claim."""

    account: str
    first: int
    last: int
    guard_position: int
    worker: str


# The library events a chaos member records (see the module docstring).
RECORDED_EVENTS = frozenset(
    {
        "member_fenced",
        "member_joined",
        "member_expired",
        "lease_lost",
        "actor.failed",
        "actor.restarting",
        "release_failed",
        "leave_failed",
        "partition_acquired",
        "supervisor.escalating",
    }
)


def _clean(text: str) -> str:
    return text.replace("\t", " ").replace("\n", " ")[:300]


class Recorder:
    """Appends delivery and event lines for one process."""

    def __init__(self, fh: TextIO, slow_seconds: float) -> None:
        self.fh = fh
        self.pid = os.getpid()
        self.slow_seconds = slow_seconds
        self.slow_next = False

    def delivery(self, group: str, m: bus.Message, member: str | None, generation: int) -> None:
        msg_id = msgspec.json.decode(m.payload)["id"]
        self.line(
            "D",
            group,
            m.topic,
            m.partition,
            m.offset,
            msg_id,
            self.pid,
            member,
            generation,
            f"{time.time():.6f}",
        )

    def line(self, *fields: Any) -> None:
        self.fh.write("\t".join(str(f) for f in fields) + "\n")

    def count(self, group: str, kind: str) -> None:
        self.line("N", group, kind)

    def mark(self, name: str, **fields: Any) -> None:
        """A "V" line: an event that makes this process's messages come again (the checker's OBSERVED)."""
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        self.line("V", f"{time.time():.6f}", name, _clean(detail))

    def maybe_stall(self) -> None:
        if not self.slow_next:
            return
        self.slow_next = False
        self.line("S", "start", f"{time.time():.6f}")
        # Blocking on purpose: the heartbeat stalls too, so the lease expires under the handler.
        time.sleep(self.slow_seconds)
        self.line("S", "end", f"{time.time():.6f}")

    def event(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        """A structlog processor: record the events in RECORDED_EVENTS, pass everything on."""
        name = event_dict.get("event")
        if name in RECORDED_EVENTS:
            detail = " ".join(
                f"{k}={v}"
                for k, v in event_dict.items()
                if k not in ("event", "exc_info", "timestamp", "level")
            )
            self.line("V", f"{time.time():.6f}", name, _clean(detail))
        return event_dict

    def error(self, kind: str, exc: BaseException) -> None:
        self.line("E", f"{time.time():.6f}", kind, _clean(repr(exc)))

    def breach(self, text: str) -> None:
        self.line("B", f"{time.time():.6f}", _clean(text))


class Ctx:
    """What every pattern loop gets."""

    def __init__(
        self, b: bus.Bus, rec: Recorder, group: str, assignor: str, stop: asyncio.Event, schema: str
    ) -> None:
        self.b = b
        self.rec = rec
        self.group = group
        self.assignor = assignor
        self.stop = stop
        self.schema = schema
        self.rng = random.Random(f"{os.getpid()}-{group}")


async def _pause(ctx: Ctx, seconds: float) -> None:
    try:
        await asyncio.wait_for(ctx.stop.wait(), seconds)
    except TimeoutError:
        pass


# -- handler style -------------------------------------------------------------------


async def run_handler(ctx: Ctx, *, dead_letter: bool) -> None:
    sub: Any = None
    rec = ctx.rec

    async def handler(m: bus.Message) -> None:
        rec.maybe_stall()
        if dead_letter:
            msg_id = msgspec.json.decode(m.payload)["id"]
            if poison(msg_id) or (number(msg_id) % 13 == 5 and m.attempt == 1):
                raise RuntimeError(f"chaos: {msg_id} fails on attempt {m.attempt}")
        rec.delivery(ctx.group, m, sub.member_id if sub else None, sub.generation if sub else -1)

    options: dict[str, Any] = {}
    if dead_letter:
        options = {"retry": RETRY, "dead_letter": f"{ctx.group}.dlq"}
    sub = await ctx.b.subscribe(
        ctx.group, handler, topics=[TOPIC], start="earliest", batch_size=50, assignor=ctx.assignor, **options
    )
    try:
        await ctx.stop.wait()
    finally:
        await sub.stop()


# -- poll style ----------------------------------------------------------------------


async def run_poll(ctx: Ctx, style: str) -> None:
    """`poll` + `commit()`, `commit_async()`, or auto-commit."""
    c: Any = None
    rec = ctx.rec

    async def commit_before_revoke(partitions: set[bus.TopicPartition]) -> None:
        # Kafka's pattern: commit what was handled while the leases are still ours, so a
        # clean handover re-delivers nothing.
        try:
            await c.commit()
        except bus.errors.BusError as exc:
            rec.error("revoke_commit", exc)

    def async_done(since: float, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            rec.error("commit_async", task.exception())  # type: ignore[arg-type]
            # Fire and forget: what it was to commit comes again to the partition's next owner.
            rec.mark("commit_failed", group=ctx.group, since=f"{since:.6f}")

    options: dict[str, Any] = {"auto_commit": style == "auto"}
    if style == "poll":
        options["on_revoke"] = commit_before_revoke
    c = ctx.b.consumer(
        ctx.group, topics=[TOPIC], start="earliest", max_poll_records=50, assignor=ctx.assignor, **options
    )
    async with c:
        while not ctx.stop.is_set():
            try:
                batch = await c.poll(timeout=0.3)
            except bus.errors.BusError as exc:
                rec.error("poll", exc)
                await asyncio.sleep(0.2)
                continue
            for m in batch:
                rec.maybe_stall()
                rec.delivery(ctx.group, m, c.member_id, c.generation)
            if not batch or style == "auto":
                continue
            if style == "commit-async":
                c.commit_async().add_done_callback(functools.partial(async_done, time.time()))
                continue
            try:
                await c.commit()
            except bus.errors.BusError as exc:
                # Stale: the partition moved on, its new owner re-reads. Unavailable: same, later.
                rec.error("commit", exc)


# -- effectively once ----------------------------------------------------------------


async def _user_work(ctx: Ctx, conn: Any, c: Any, batch: list[bus.Message]) -> None:
    """The user's writes for a batch, then a little work while the transaction stays open."""
    rows = []
    for m in batch:
        ctx.rec.maybe_stall()
        ctx.rec.delivery(ctx.group, m, c.member_id, c.generation)
        msg_id = msgspec.json.decode(m.payload)["id"]
        rows.append(
            (ctx.group, m.topic, m.partition, m.offset, msg_id, ctx.rec.pid, c.member_id, time.time())
        )
    await conn.executemany(INSERT_ROW.format(schema=ctx.schema), rows)
    await asyncio.sleep(ctx.rng.uniform(0.0, 0.3))


async def run_tx(ctx: Ctx) -> None:
    """API.md's `async with c.transaction() as tx:` loop."""
    rec = ctx.rec
    c = ctx.b.consumer(
        ctx.group,
        topics=[TOPIC],
        start="earliest",
        auto_commit=False,
        max_poll_records=50,
        assignor=ctx.assignor,
    )
    async with c:
        while not ctx.stop.is_set():
            polled = 0
            since = time.time()
            try:
                async with c.transaction() as tx:
                    batch = await c.poll(timeout=0.3)
                    polled = len(batch)
                    if batch:
                        await _user_work(ctx, tx.connection, c, batch)
            except Exception as exc:  # any error: the bus rolled back and rewound; the batch comes again
                rec.error("transaction", exc)
                if polled:
                    rec.mark("rolled_back", group=ctx.group, messages=polled, since=f"{since:.6f}")
                    rec.count(ctx.group, "rolled_back")
                await asyncio.sleep(0.1)
            else:
                if polled:
                    rec.count(ctx.group, "committed")


async def run_txh(ctx: Ctx) -> None:
    """API.md's transactional handler: the row, the offset and the dead letter in one transaction."""
    sub: Any = None
    rec = ctx.rec
    insert = INSERT_ROW.format(schema=ctx.schema)

    async def handler(m: bus.Message, tx: bus.Transaction) -> None:
        rec.maybe_stall()
        msg_id = msgspec.json.decode(m.payload)["id"]
        member = sub.member_id if sub else None
        await tx.connection.execute(
            insert, ctx.group, m.topic, m.partition, m.offset, msg_id, rec.pid, member, time.time()
        )
        if poison(msg_id) or (number(msg_id) % 13 == 5 and m.attempt == 1):
            raise RuntimeError(f"chaos: {msg_id} fails on attempt {m.attempt}")  # its row rolls back
        rec.delivery(ctx.group, m, member, sub.generation if sub else -1)
        await asyncio.sleep(ctx.rng.uniform(0.0, 0.01))  # the transaction stays open a little

    sub = await ctx.b.subscribe(
        ctx.group,
        handler,
        topics=[TOPIC],
        start="earliest",
        batch_size=50,
        assignor=ctx.assignor,
        transactional=True,
        retry=RETRY,
        dead_letter=f"{ctx.group}.dlq",
    )
    try:
        await ctx.stop.wait()
    finally:
        await sub.stop()


async def run_txlow(ctx: Ctx) -> None:
    """The low-level loop: the user's transaction, `commit(connection=conn)`, `rewind()` after any error."""
    rec = ctx.rec
    c = ctx.b.consumer(
        ctx.group,
        topics=[TOPIC],
        start="earliest",
        auto_commit=False,
        max_poll_records=50,
        assignor=ctx.assignor,
    )
    can_rewind = hasattr(c, "rewind")
    async with c:
        while not ctx.stop.is_set():
            try:
                batch = await c.poll(timeout=0.3)
            except bus.errors.BusError as exc:
                rec.error("poll", exc)
                await asyncio.sleep(0.2)
                continue
            if not batch:
                continue
            since = time.time()
            try:
                async with ctx.b.pool.acquire() as conn, conn.transaction():
                    await _user_work(ctx, conn, c, batch)
                    await c.commit(connection=conn)
            except Exception as exc:  # nothing of this batch applied (or unknown): rewind before polling
                rec.error("commit_connection", exc)
                rec.mark("rolled_back", group=ctx.group, messages=len(batch), since=f"{since:.6f}")
                rec.count(ctx.group, "rolled_back")
                while can_rewind and not ctx.stop.is_set():
                    try:
                        await c.rewind()
                        break
                    except bus.errors.BusError as exc2:
                        rec.error("rewind", exc2)
                        await asyncio.sleep(0.2)
            else:
                rec.count(ctx.group, "committed")


# -- claims --------------------------------------------------------------------------


async def run_claims(ctx: Ctx) -> None:
    rec, group = ctx.rec, ctx.group
    worker = f"w{rec.pid}"
    while not ctx.stop.is_set():
        try:
            claim = await ctx.b.claim(
                group,
                topic=TOPIC,
                worker_id=worker,
                max_messages=20,
                lease_time=CLAIM_LEASE,
                start="earliest",
            )
        except bus.errors.BusError as exc:
            rec.error("claim", exc)
            await asyncio.sleep(0.2)
            continue
        if claim is None:
            await asyncio.sleep(0.05)
            continue
        since = f"{time.time():.6f}"  # a mark spans from here: the lease may lapse under slow work
        epoch = claim.lease_epoch
        roll = ctx.rng.random()
        try:
            if roll < 0.08:  # give it back untouched: the same messages come again
                await claim.release()
                rec.count(group, "released")
                continue
            upto = claim.messages
            if roll < 0.18 and len(claim.messages) > 1:  # handle part, ack up to there
                upto = claim.messages[: len(claim.messages) // 2]
            for m in upto:
                rec.maybe_stall()
                rec.delivery(group, m, worker, epoch)
            if roll > 0.92:  # slow work: past the lease, then extend
                # Marked ahead (the process may be killed meanwhile): another worker may take
                # the partition once the lease lapses, and get these messages again.
                now, pause = time.time(), CLAIM_LEASE + 0.5
                rec.line("V", f"{now + pause:.6f}", "slow_work", f"group={group} since={now:.6f}")
                await asyncio.sleep(pause)
                try:
                    await claim.extend(5.0)
                    rec.count(group, "extended")
                except bus.errors.LeaseLostError:
                    rec.mark("lease_lost", group=group, partition=claim.partition, epoch=epoch, since=since)
                    rec.count(group, "extend_lease_lost")
                    try:
                        await claim.ack()
                    except bus.errors.LeaseLostError:
                        pass
                    else:
                        rec.breach(
                            f"{group}: ack() after extend() raised LeaseLostError returned silently "
                            f"({claim.topic}/{claim.partition} epoch {epoch})"
                        )
                    continue
            await claim.ack(upto[-1].offset if upto is not claim.messages else None)
            rec.count(group, "partial_ack" if upto is not claim.messages else "acked")
            for m in upto:
                rec.line(
                    "K",
                    group,
                    m.topic,
                    m.partition,
                    m.offset,
                    msgspec.json.decode(m.payload)["id"],
                    rec.pid,
                    epoch,
                    f"{time.time():.6f}",
                )
        except bus.errors.LeaseLostError as exc:
            rec.mark("lease_lost", group=group, partition=claim.partition, epoch=epoch, since=since)
            rec.error("claim_ack", exc)
        except bus.errors.BusError as exc:  # unknown outcome: the lease runs out, the messages come again
            rec.mark("claim_failed", group=group, partition=claim.partition, epoch=epoch, since=since)
            rec.error("claim_ack", exc)


# -- queues --------------------------------------------------------------------------


async def run_queue(ctx: Ctx) -> None:
    rec, group = ctx.rec, ctx.group
    async with ctx.b.queue_consumer(
        QUEUE, visibility_timeout=QUEUE_VISIBILITY, max_attempts=QUEUE_MAX_ATTEMPTS
    ) as q:
        batches = 0
        while not ctx.stop.is_set():
            try:
                jobs = await q.take(max_messages=10, timeout=0.5)
            except bus.errors.BusError as exc:
                rec.error("take", exc)
                await asyncio.sleep(0.2)
                continue
            if not jobs:
                continue
            since = f"{time.time():.6f}"
            batches += 1
            done: list[bus.Message] = []
            try:
                for job in jobs:
                    rec.maybe_stall()
                    msg_id = msgspec.json.decode(job.payload)["id"]
                    n = number(msg_id)
                    rec.delivery(group, job, q.consumer_id, job.attempt)
                    if poison(msg_id) or (n % 7 == 3 and job.attempt == 1):
                        rec.mark("nacked", group=group, job=f"{job.partition}@{job.offset}")
                        await q.nack(job, delay=0.1, error="poison" if poison(msg_id) else "transient")
                        rec.count(group, "nacked")
                    elif n % 11 == 4 and job.attempt == 1:
                        rec.mark("abandoned", group=group, job=f"{job.partition}@{job.offset}")
                        rec.count(group, "abandoned")
                    else:
                        done.append(job)
                if batches % 2:
                    await q.ack_many(done)
                    rec.count(group, "ack_many")
                else:
                    for job in done:
                        await q.ack(job)
                for job in done:
                    rec.line(
                        "K",
                        group,
                        job.topic,
                        job.partition,
                        job.offset,
                        msgspec.json.decode(job.payload)["id"],
                        rec.pid,
                        job.attempt,
                        f"{time.time():.6f}",
                    )
            except bus.errors.LeaseLostError as exc:
                rec.mark("lease_lost", group=group, since=since)
                rec.error("queue_ack", exc)
            except bus.errors.BusError as exc:  # the jobs come back after their visibility timeout
                rec.mark("queue_failed", group=group, since=since)
                rec.error("queue_ack", exc)


async def run_lqueue(ctx: Ctx) -> None:
    rec, group = ctx.rec, ctx.group
    async with ctx.b.queue_consumer(
        LQUEUE, visibility_timeout=LQUEUE_VISIBILITY, max_attempts=LQUEUE_MAX_ATTEMPTS
    ) as q:
        while not ctx.stop.is_set():
            asked = time.time()
            try:
                jobs = await q.take(max_messages=LQUEUE_TAKE, timeout=0.5)
            except bus.errors.BusError as exc:
                rec.error("take", exc)
                await asyncio.sleep(0.2)
                continue
            got = time.time()
            ids = [msgspec.json.decode(job.payload)["id"] for job in jobs]
            for job, msg_id in zip(jobs, ids, strict=True):
                rec.line(
                    "J",
                    group,
                    job.topic,
                    job.partition,
                    job.offset,
                    msg_id,
                    job.key or "-",
                    f"{asked:.6f}",
                    f"{got:.6f}",
                )
            for job, msg_id in zip(jobs, ids, strict=True):
                rec.maybe_stall()
                rec.delivery(group, job, q.consumer_id, job.attempt)
                await asyncio.sleep(ctx.rng.uniform(0.01, 0.06))  # the work: the batch's jobs stay in flight
                since = f"{time.time():.6f}"
                try:
                    if number(msg_id) % 9 == 2 and job.attempt == 1:
                        rec.mark("nacked", group=group, job=f"{job.partition}@{job.offset}")
                        await q.nack(job, delay=0.1, error="transient")
                        rec.count(group, "nacked")
                        continue
                    acked_from = time.time()
                    await q.ack(job)
                except bus.errors.LeaseLostError as exc:
                    rec.mark("lease_lost", group=group, since=since)
                    rec.error("queue_ack", exc)
                    continue
                except bus.errors.BusError as exc:  # the job comes back after its visibility timeout
                    rec.mark("queue_failed", group=group, since=since)
                    rec.error("queue_ack", exc)
                    continue
                rec.line("Y", group, job.topic, job.partition, job.offset, f"{acked_from:.6f}")
                rec.line(
                    "K",
                    group,
                    job.topic,
                    job.partition,
                    job.offset,
                    msg_id,
                    rec.pid,
                    job.attempt,
                    f"{time.time():.6f}",
                )


# -- event store ---------------------------------------------------------------------


async def run_es(ctx: Ctx) -> None:
    rec, group = ctx.rec, ctx.group
    worker = f"es{rec.pid}"
    store = ctx.b.event_store(STORE)
    while not ctx.stop.is_set():
        try:
            await store.register_group(group)
            break
        except bus.errors.BusError as exc:
            rec.error("register_group", exc)
            await asyncio.sleep(0.2)
    beat = 0.0
    while not ctx.stop.is_set():
        try:
            if time.monotonic() - beat > 0.5:
                await store.heartbeat(worker)
                beat = time.monotonic()
            # The default batch: a guard covers what the claim returned, so a claim that left
            # events of its partition behind (a backlog beyond max_messages) always conflicts.
            c = await store.claim_next(
                group, partition_by=["account"], handled_types=[Item], worker_id=worker
            )
        except bus.errors.BusError as exc:
            rec.error("claim_next", exc)
            await asyncio.sleep(0.2)
            continue
        if c is None:
            await asyncio.sleep(0.05)
            continue
        account = c.partition_value["account"]
        since = f"{time.time():.6f}"
        for pe in c.messages:
            rec.maybe_stall()
            rec.line(
                "D",
                group,
                STORE,
                account,
                pe.position,
                pe.message.id,
                rec.pid,
                worker,
                c.offset_id,
                f"{time.time():.6f}",
            )
        first, last = c.messages[0].position, c.messages[-1].position
        await asyncio.sleep(ctx.rng.uniform(0.0, 0.05))
        try:
            tally = Tally(
                account=account, first=first, last=last, guard_position=c.guard.position, worker=worker
            )
            try:
                await store.append(tally, guard=c.guard)
            except bus.errors.ConcurrentAppendError:
                rec.mark("guard_conflict", group=group, account=account)
                rec.count(group, "guard_conflict")
                await store.release(group, c.offset_id, worker_id=worker)
                continue
            rec.count(group, "tally")
            await store.ack(group, offset_id=c.offset_id, position=last, worker_id=worker)
            for pe in c.messages:
                rec.line(
                    "K",
                    group,
                    STORE,
                    account,
                    pe.position,
                    pe.message.id,
                    rec.pid,
                    c.offset_id,
                    f"{time.time():.6f}",
                )
        except bus.errors.LeaseLostError as exc:
            rec.mark("lease_lost", group=group, account=account, since=since)
            rec.error("es_ack", exc)
        except bus.errors.BusError as exc:  # unknown outcome: give the claim back, its events come again
            rec.mark("es_failed", group=group, account=account, since=since)
            rec.error("es_ack", exc)
            # Until it is given back (or gone): this worker's heartbeats keep its claims alive, so one
            # it gave up releasing (the database away for longer than a few tries) would stay held.
            while True:
                try:
                    await store.release(group, c.offset_id, worker_id=worker)
                    break
                except bus.errors.LeaseLostError:
                    break
                except bus.errors.BusError:
                    await asyncio.sleep(0.2)


PATTERNS = {
    "handler": lambda ctx: run_handler(ctx, dead_letter=False),
    "handler-dlq": lambda ctx: run_handler(ctx, dead_letter=True),
    "poll": lambda ctx: run_poll(ctx, "poll"),
    "commit-async": lambda ctx: run_poll(ctx, "commit-async"),
    "auto": lambda ctx: run_poll(ctx, "auto"),
    "tx": run_tx,
    "txh": run_txh,
    "txlow": run_txlow,
    "claims": run_claims,
    "queue": run_queue,
    "lqueue": run_lqueue,
    "es": run_es,
}


def plain_tracebacks(*first: Any) -> None:
    """Log tracebacks plain (after the processors `first`).

    The default (rich, with locals) blocks the event loop for seconds per
    traceback on loaded cores: after a database restart it fenced every member
    and held every publish of a producer for 20-30 s.
    """
    processors = [
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
        if isinstance(p, structlog.dev.ConsoleRenderer)
        else p
        for p in structlog.get_config()["processors"]
    ]
    structlog.configure(processors=[*first, *processors])


async def watch_loop_lag(rec: Recorder, every: float = 0.1, report: float = 0.5) -> None:
    """Record "V time loop_lag seconds=N" when this process's event loop ran late by more than `report`.

    A late loop (CPU starved, blocked) delays heartbeats like a pause does: it tells
    a fence that followed from a bus actor that was stuck on its own.
    """
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(every)
        late = loop.time() - t0 - every
        if late > report:
            rec.line("V", f"{time.time():.6f}", "loop_lag", f"seconds={late:.3f}")


async def run_pattern(ctx: Ctx, pattern: str) -> None:
    """One group's loop; an unexpected error is recorded and the loop starts again (a user's supervisor)."""
    while not ctx.stop.is_set():
        try:
            await PATTERNS[pattern](ctx)
        except Exception as exc:
            ctx.rec.error(f"{pattern}_loop", exc)
            await asyncio.sleep(0.5)


async def main() -> None:
    dsn, schema, out, slow, spec = sys.argv[1:6]
    dsn = os.environ["BUS_DSN"] if dsn == "-" else dsn  # "-": from the environment (no password in argv)
    config: dict[str, Any] = {"schema": schema}
    slow_seconds = 0.0
    for kv in sys.argv[6:]:
        k, v = kv.split("=", 1)
        if k == "slow_seconds":
            slow_seconds = float(v)
        else:
            config[k] = float(v)
    members = [tuple(s.split(":")) for s in spec.split(",")]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    with open(out, "a", buffering=1) as fh:  # noqa: ASYNC230 (once, at start-up)
        rec = Recorder(fh, slow_seconds)
        # Every library event passes through rec.event first.
        plain_tracebacks(rec.event)
        if slow == "1":
            loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(rec, "slow_next", True))
        watchdog = asyncio.create_task(watch_loop_lag(rec))
        # Joining may meet the database down (a restart): the documented answer is to retry.
        while not stop.is_set():
            try:
                async with bus.connect(dsn, **config) as b:
                    tasks = [
                        asyncio.create_task(run_pattern(Ctx(b, rec, group, assignor, stop, schema), pattern))
                        for group, pattern, assignor in members
                    ]
                    await asyncio.sleep(0.5)
                    print("joined", flush=True)
                    await asyncio.gather(*tasks)
            except bus.errors.StorageUnavailableError as exc:
                rec.error("start", exc)
                await asyncio.sleep(0.5)
        watchdog.cancel()
    print("stopped", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
