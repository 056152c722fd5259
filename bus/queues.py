"""Competing consumers on `semantics="queue"` topics (no group name, Queen's queue mode).

    async with b.queue_consumer("jobs", visibility_timeout=30.0, max_attempts=5) as q:
        for job in await q.take(max_messages=10, timeout=1.0):
            try:
                work(job)
            except Exception as exc:
                await q.nack(job, delay=2.0, error=repr(exc))
            else:
                await q.ack(job)

- Each message is leased to one consumer at a time (fresh ones by range, see storage/queues.py).
- A message not acked within `visibility_timeout` seconds comes back; so does
  a nacked one, after its `delay`.
- A message delivered `max_attempts` times and still not acked is moved to the
  dead-letter topic (default `"<topic>.dlq"`; created as a one-partition queue
  topic if missing, so it can be drained with a queue consumer too). Its
  headers keep the original ones plus `dead_letter.topic`, `.partition`,
  `.offset`, `.attempts`, `.last_error` and `.errors` (the JSON list of every
  attempt's error: nack reasons and expired visibility timeouts).
- `ordered_by_key=True`: a key's jobs go out one at a time, in offset order
  (the next one only once the previous is acked or dead-lettered).
- Acks and nacks are fenced: if a job's lease ran out and another consumer
  took it, acking the old copy raises LeaseLostError and changes nothing. An
  expired lease nobody took yet still accepts the ack.

Waiting: an idle `take` sleeps until the Bus's one LISTEN connection (the
Notifier) says a partition of the topic got a job, until the next delayed or
expired job becomes visible, or at the latest `max_poll_interval` seconds
(the fallback for a lost notification). A take is one statement; concurrent
acks of one consumer (`ack` and `ack_many` from many tasks) are coalesced
into one statement per round trip, the way the Producer coalesces publishes;
the takes of all consumers of one Bus are likewise dealt from one statement
(up to 100 jobs per statement: bigger takes of one moment use the two write
slots side by side).
A take does not wait for its WAL flush (a lease is soft state: if PostgreSQL
crashes right after, those jobs are simply delivered again); an ack does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import asyncpg
import msgspec

from actors import metrics as _metrics
from actors.lane import Lane
from actors.messages import Subscribe, Unsubscribe
from actors.runtime import Actor, ActorRef
from actors.runtime import Message as ActorMessage
from bus import queue_features, tracing
from bus.codec import decode_headers
from bus.context import context_of
from bus.queue_expiry import ExpiryBound
from bus.types import Message, Outgoing
from storage import db
from storage import job_features as job_sql
from storage import queue_controls as controls
from storage import queues as sql
from storage.db import Connection
from storage.errors import LeaseLostError, TopicNotFoundError, ValidationError
from storage.logs import get_logger
from storage.names import validate_int, validate_name, validate_seconds

if TYPE_CHECKING:
    from bus.context import BusContext, Connected

__all__ = ["QueueConsumer"]

log = get_logger(__name__)

_errors_decoder = msgspec.json.Decoder(list[dict[str, Any]])
_encoder = msgspec.json.Encoder()

# A job is visible but our take did not get it (another taker's statement had
# it locked, or it became visible just after): look again this soon.
_RETRY_SOON = 0.005
# Ack calls per statement: bounds one statement's size when thousands of acks
# pile up behind a slow round trip.
_MAX_ACK_BATCH = 1_000
# Takers per leasing statement.
_MAX_TAKERS = 100
# Writes of one kind out at once per Bus: two keep the database busy while the
# next batch gathers; more would only split the batches.
_PARALLEL = 2
# Jobs per statement beyond which the requests of one moment are split over the free write
# slots: a statement's fixed cost is small next to a hundred rows' work, so two consumers taking
# 100 each are served side by side, while many small takes and acks still share one statement.
_SPLIT_AT = 100
_names = itertools.count()

_Job = tuple[int, int, int]  # (partition_id, offset, lease_epoch)
_Lease = tuple[int, int, int | None]  # (partition_id, lease_epoch, range lease id or None)
# The answer of one ack write: the (partition_id, offset) it deleted.
_AckWrite: TypeAlias = "asyncio.Future[set[tuple[int, int]]]"
_Shared: TypeAlias = "tuple[Message, int, _AckWrite]"  # a job whose ack another call already sent


class _Doorbell:
    """Wakes every task waiting for new jobs; `rings` counts the wake-ups so none is missed between looks."""

    def __init__(self) -> None:
        self.rings = 0
        self._waiters: set[asyncio.Future[None]] = set()

    def ring(self) -> None:
        """New jobs may be there: wake every waiter."""
        self.rings += 1
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self, seen: int, timeout: float) -> None:  # noqa: ASYNC109 - a wait bounded by the caller's deadline
        """Return at the first ring after `seen` rings, or after `timeout` seconds."""
        if self.rings != seen:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)


_AckRequest = tuple[list[_Job], set[int], _AckWrite]
_TakeRequest = tuple[str, int, "asyncio.Future[list[sql.TakenJob]]"]


def _ack_weight(request: _AckRequest) -> int:
    return len(request[0])


def _take_weight(request: _TakeRequest) -> int:
    return request[1]


class _DeadRow(msgspec.Struct, frozen=True, gc=False):
    """A job on its way to the dead-letter topic: its lease, message and attempts so far."""

    partition_id: int
    offset: int
    lease_epoch: int
    attempts: int
    partition: str
    key: str | None
    payload: bytes | None
    headers: dict[str, str]


class _QueueWriter:
    """The acks and takes of every queue consumer of one Bus, coalesced.

    On a queue the cost is the statement and its commit, not the rows. Acks
    form one lane and the takes of each (topic, visibility timeout, ordering)
    another; a lane has at most `_PARALLEL` writes out at a time, and
    whatever its consumers ask while they are out goes in the next one: all
    pending acks in one DELETE, all pending takes of a topic in one leasing
    statement. With a write slot free a request is written at once. Each
    write is one autocommit statement; every caller gets its own answer (or
    the write's exception) once it committed.
    """

    def __init__(
        self, lender: db.Lender, now: db.Now, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._lender = lender
        self._monotonic = monotonic  # the Bus's clock, for the expiry bounds' full-scan periods
        self._now = now  # the time the takes judge leases by (the Bus's context: a test's Clock moves it)
        self._acks: Lane[_AckRequest] = Lane(
            self._write_acks, _MAX_ACK_BATCH, _PARALLEL, weight=_ack_weight, split_at=_SPLIT_AT
        )
        self._takes: dict[tuple[str, float, bool, bool], Lane[_TakeRequest]] = {}
        # The queues last found to have limits: taken the limited way at once (see take_for).
        self._limited_topics: set[str] = set()
        # Per topic, below which its range leases were reclaimed: where the takes' scans for leases
        # that ran out start (every take of a topic from this Bus is written here).
        self._expiry: dict[str, ExpiryBound] = {}
        # When this Bus next empties the lease slots the clock has left (rotate_leases).
        self._rotate_due = monotonic() + sql.ROTATE_EVERY

    def expiry(self, topic: str) -> ExpiryBound:
        """The bound of `topic`'s scans for range leases that ran out (the first take scans fully)."""
        bound = self._expiry.get(topic)
        if bound is None:
            bound = self._expiry[topic] = ExpiryBound(clock=self._monotonic)
        return bound

    def ack(self, jobs: list[_Job], leases: set[int]) -> asyncio.Future[set[tuple[int, int]]]:
        """Delete the jobs whose leases still hold; the future holds the (partition_id, offset) deleted.

        `leases`: the range leases the jobs came from (deleted once empty).
        """
        future: asyncio.Future[set[tuple[int, int]]] = asyncio.get_running_loop().create_future()
        self._acks.add((jobs, leases, future))
        return future

    def take(
        self,
        topic: str,
        limit: int,
        visibility_timeout: float,
        consumer: str,
        ordered: bool,
        fair: bool = False,
    ) -> asyncio.Future[list[sql.TakenJob]]:
        """Lease up to `limit` jobs of `topic` to `consumer` (`fair`: rotating across keys); the future holds the rows."""
        future: asyncio.Future[list[sql.TakenJob]] = asyncio.get_running_loop().create_future()
        self.expiry(topic).leasing(visibility_timeout)
        key = (topic, visibility_timeout, ordered, fair)
        lane = self._takes.get(key)
        if lane is None:
            lane = self._takes[key] = Lane[_TakeRequest](
                lambda batch: self._write_takes(key, batch),
                _MAX_TAKERS,
                _PARALLEL,
                weight=_take_weight,
                split_at=_SPLIT_AT,
            )
        lane.add((consumer, limit, future))
        return future

    async def _write_acks(self, batch: list[_AckRequest]) -> None:
        with db.translate_errors():
            done = await sql.ack_many(
                self._lender,
                [job for jobs, _, _ in batch for job in jobs],
                {lease for _, leases, _ in batch for lease in leases},
            )
        for _, _, future in batch:
            if not future.done():
                future.set_result(done)

    async def _write_takes(self, key: tuple[str, float, bool, bool], batch: list[_TakeRequest]) -> None:
        topic, timeout, ordered, fair = key
        consumers, limits = [c for c, _, _ in batch], [n for _, n, _ in batch]
        with db.translate_errors():
            dealt = await sql.take_for(
                self._lender,
                topic,
                consumers,
                limits,
                timeout,
                ordered=ordered,
                limited_topics=self._limited_topics,
                now=self._now(),
                expiry=self.expiry(topic),
                fair=fair,
            )
        # A limited queue's takes run one at a time in every process anyway (storage/queues.py):
        # one write at a time here, with every request that arrived meanwhile, instead of two
        # that would wait for each other.
        if topic in self._limited_topics:
            self._takes[key].reshape(1, 0)
        else:
            self._takes[key].reshape(_PARALLEL, _SPLIT_AT)
        for (_, _, future), mine in zip(batch, dealt, strict=True):
            if not future.done():
                future.set_result(mine)
        if self._monotonic() >= self._rotate_due:
            await self._rotate_leases()

    async def _rotate_leases(self) -> None:
        """Truncate the lease slots no take writes to now (the takes it delayed already have their jobs).

        A rotation that fails changes nothing (one transaction): the slots keep their leases
        until the next one, ROTATE_EVERY seconds on.
        """
        self._rotate_due = self._monotonic() + sql.ROTATE_EVERY
        try:
            await sql.rotate_leases(self._lender)
        except (asyncpg.PostgresError, OSError) as exc:
            log.warning("queue_rotate_leases_failed", error=repr(exc))


def _writer_of(ctx: BusContext) -> _QueueWriter:
    return ctx.state(_QueueWriter, lambda: _QueueWriter(ctx.lender, lambda: ctx.now(), ctx.time.monotonic))


class QueueWake(ActorMessage, frozen=True):
    """A partition of the watched queue topic was notified (a publish, a job given back)."""


class QueueWaker(Actor[QueueWake]):
    """Connects one queue consumer to the Bus's Notifier: its NOTIFYs ring the consumer's doorbell.

    The Bus keeps one LISTEN connection however many consumers wait; this
    actor only holds the consumer's subscriptions to it: one per partition id
    of a fixed topic, or every notification of the schema for a dynamic
    topic (whose partitions appear as keys are published).
    """

    # A wake-up already queued covers any dropped after it.
    mailbox_size = 16

    def __init__(self, notifier: ActorRef[Any], doorbell: _Doorbell) -> None:
        self._notifier = notifier
        self._doorbell = doorbell

    @staticmethod
    async def subscribe(
        notifier: ActorRef[Any], ref: ActorRef[Any], channel: str, keys: tuple[str | None, ...]
    ) -> None:
        """Subscribe `ref` and wait until the Notifier listens, so the NOTIFY of any later commit rings.

        Done by the consumer's `start` rather than `on_start`, so a publish
        right after `start` returns is sure to ring; the subscriptions belong
        to the ref and so outlive a restart of this actor.
        """
        for key in keys:
            await notifier.ask(Subscribe(channel, key, ref, QueueWake(), catch_up=False))

    async def on_stop(self) -> None:
        """Leave the Notifier's subscription table."""
        self._notifier.signal(Unsubscribe(self.self_ref))

    async def receive(self, message: QueueWake) -> None:
        """A NOTIFY for the topic: wake the consumer's waiting takes."""
        self._doorbell.ring()


class QueueConsumer:
    """One competing consumer of a queue topic. Use as `async with b.queue_consumer(...) as q`."""

    def __init__(
        self,
        ctx: BusContext | Connected,
        topic: str,
        *,
        visibility_timeout: float | timedelta = 30.0,
        max_attempts: int = 5,
        dead_letter: str | None = None,
        ordered_by_key: bool = False,
    ) -> None:
        validate_name(topic, "topic name")
        self.visibility_timeout = validate_seconds(visibility_timeout, "visibility_timeout")
        self.topic = topic
        self.max_attempts = validate_int(max_attempts, "max_attempts", 1)
        self.dead_letter = validate_name(
            dead_letter if dead_letter is not None else f"{topic}.dlq", "dead_letter topic"
        )
        if self.dead_letter == topic:
            raise ValidationError("dead_letter must be another topic than the queue itself")
        self.ordered_by_key = bool(ordered_by_key)
        self.consumer_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ctx = ctx = context_of(ctx)
        # (partition name, offset) -> (partition_id, lease epoch, range lease id), for every job taken and not
        # yet acked/nacked.
        self._in_flight: dict[tuple[str, int], _Lease] = {}
        self._partitions: dict[int, str] = {}  # partition id -> name
        self._doorbell = _Doorbell()
        self._waker: ActorRef[Any] | None = None
        self._system: Any = None
        # The answer every acker of a job shares while its ack is on the way.
        self._acking: dict[tuple[str, int], asyncio.Future[set[tuple[int, int]]]] = {}
        self._writer = _writer_of(ctx)
        self._giving_back: set[asyncio.Task[None]] = set()
        self._missed = 0  # empty takes in a row while a job was visible
        self._fair = False  # the queue was created with fair=True (read at start)
        self._open = False
        self._log = log.bind(topic=topic, consumer=self.consumer_id)

    async def __aenter__(self) -> QueueConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Check the topic is a queue, make sure the dead-letter topic exists, and start listening for jobs."""
        info = await self._ctx.topic(self.topic)
        if info.semantics != "queue":
            raise ValidationError(
                f"topic {self.topic!r} has semantics={info.semantics!r}; queue consumers need a topic created with "
                "semantics='queue' (use b.consumer(...) or b.claim(...) for pubsub topics)"
            )
        try:
            await self._ctx.topic(self.dead_letter)
        except TopicNotFoundError:
            await self._ctx.create_topic(self.dead_letter, partitions=1, semantics="queue")
            self._log.info("dead_letter_topic_created", dead_letter=self.dead_letter)
        with db.translate_errors():
            self._partitions = await sql.partitions(self._ctx.pool, self.topic)
            settings = await controls.get(self._ctx.pool, self.topic)
        self._fair = settings is not None and bool(settings["fair"])
        keys: tuple[str | None, ...] = (
            (None,) if info.dynamic else tuple(str(pid) for pid in sorted(self._partitions))
        )
        self._system = system = await self._ctx.group_system()
        notifier, doorbell = system.notifier, self._doorbell
        assert notifier is not None  # started with the system
        self._waker = system.root.spawn(
            lambda: QueueWaker(notifier, doorbell), f"queue-waker-{self.topic}-{next(_names)}"
        )
        await QueueWaker.subscribe(notifier, self._waker, self._ctx.channels.messages, keys)
        self._open = True

    async def close(self) -> None:
        """Give back every job taken and not acked (immediately visible, the attempt not counted)."""
        if not self._open:
            return
        self._open = False
        if self._acking:
            await asyncio.wait(set(self._acking.values()))
        if self._waker is not None:
            await self._waker.stop(drain=False)
            self._waker = None
        if self._in_flight:
            jobs = [(v[0], k[1], v[1]) for k, v in self._in_flight.items()]
            self._in_flight.clear()
            try:
                with db.translate_errors():
                    await sql.return_unacked(self._ctx.pool, jobs, self._ctx.now())
                self._announce({j[0] for j in jobs})
            except Exception:  # closing must not fail; the jobs come back by timeout anyway
                self._log.warning("queue_return_unacked_failed", exc_info=True)

    def _check_open(self) -> None:
        if not self._open:
            raise ValidationError(
                "the queue consumer is not open: use `async with b.queue_consumer(...) as q`"
            )

    def _announce(self, partition_ids: set[int]) -> None:
        """Wake the other consumers: jobs of these partitions became free without a publish."""
        if self._system is not None:
            for pid in partition_ids:
                self._system.announce(pid)

    async def take(self, max_messages: int = 10, timeout: float | timedelta = 1.0) -> list[Message]:  # noqa: ASYNC109 - the public API's shape
        """Lease up to `max_messages` jobs to this consumer, waiting up to `timeout` seconds for the first.

        While there is nothing to take it waits for a NOTIFY of the topic's
        partitions, for the next delayed job to become visible, or at most
        the Bus's `max_poll_interval` (in case a notification was lost).
        """
        self._check_open()
        validate_int(max_messages, "max_messages", 1, 10_000)
        deadline = time.monotonic() + validate_seconds(timeout, "timeout", allow_zero=True)
        while True:
            seen = self._doorbell.rings
            got = await self._take_once(max_messages)
            remaining = deadline - time.monotonic()
            if got:
                self._missed = 0
                tracing.received("take", got)
                return got
            if remaining <= 0:
                return got
            pause = await self._idle_pause()
            await self._doorbell.wait(seen, min(pause, remaining))

    async def _idle_pause(self) -> float:
        """How long an empty take may sleep when no NOTIFY comes."""
        fallback = self._ctx.config.fallback_poll
        with db.translate_errors():
            until = await sql.seconds_until_visible(
                self._ctx.pool, self.topic, self._ctx.now(), self._writer.expiry(self.topic), fallback
            )
        if until is None:
            return fallback
        if until <= 0:
            # Ordered: a visible job may wait behind its key's earlier one, whose ack announces it.
            # A visible job a take did not get again and again is held back by the queue's limits
            # (a key at its limit, the rate used up): look again less and less often.
            self._missed += 1
            soon = min(_RETRY_SOON * (1 << min(self._missed, 5)), fallback)
            return fallback if self.ordered_by_key else soon
        return min(until, fallback)

    async def _take_once(self, limit: int) -> list[Message]:
        out: list[Message] = []
        pool = self._ctx.pool
        with db.translate_errors():
            for _ in range(10):  # each round dead-letters what it found exhausted
                asked = limit - len(out)
                pending = self._writer.take(
                    self.topic,
                    asked,
                    self.visibility_timeout,
                    self.consumer_id,
                    self.ordered_by_key,
                    self._fair,
                )
                try:
                    # Shielded: the write may be shared with other consumers' takes.
                    rows = await asyncio.shield(pending)
                except asyncio.CancelledError:
                    # Whatever it leases to us now nobody will see: give it back at once.
                    pending.add_done_callback(self._give_back)
                    raise
                exhausted: list[_DeadRow] = []
                topic, max_attempts, in_flight = self.topic, self.max_attempts, self._in_flight
                for _, pid, offset, attempts, epoch, lease_id, key, text, payload, created_at, _, _ in rows:
                    name = self._partitions.get(pid)
                    if name is None:
                        name = await self._refresh_partitions(pid)
                    headers = decode_headers(text) if text else {}
                    if attempts > max_attempts:
                        exhausted.append(_DeadRow(pid, offset, epoch, attempts, name, key, payload, headers))
                        continue
                    in_flight[(name, offset)] = (pid, epoch, lease_id)
                    out.append(
                        Message(
                            topic=topic,
                            partition=name,
                            offset=offset,
                            key=key,
                            headers=headers,
                            payload=payload,
                            created_at=created_at,
                            attempt=attempts,
                        )
                    )
                if exhausted:
                    async with pool.acquire() as conn, conn.transaction():
                        await self._dead_letter_rows(conn, exhausted, None)
                if not exhausted or len(out) >= limit or len(rows) < asked:
                    break
        _metrics.queue_taken(self.topic, len(out))
        return out

    def _give_back(self, taken: asyncio.Future[list[sql.TakenJob]]) -> None:
        """Return the jobs of a take whose caller was cancelled before it answered."""
        if taken.cancelled() or taken.exception() is not None or not taken.result():
            return
        jobs = [(r[sql.PARTITION_ID], r[sql.OFFSET], r[sql.LEASE_EPOCH]) for r in taken.result()]

        async def give_back() -> None:
            try:
                with db.translate_errors():
                    await sql.return_unacked(self._ctx.lender, jobs, self._ctx.now())
                self._announce({j[0] for j in jobs})
            except Exception:  # the jobs come back by their visibility timeout anyway
                self._log.warning("queue_give_back_failed", exc_info=True)

        task = asyncio.get_running_loop().create_task(give_back())
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def _refresh_partitions(self, pid: int) -> str:
        """The name of a partition created after this consumer started (dynamic topics)."""
        self._partitions = await sql.partitions(self._ctx.pool, self.topic)
        return self._partitions.get(pid, "?")

    def _check_topic(self, msg: Message) -> None:
        if msg.topic != self.topic:
            raise ValidationError(
                f"message of topic {msg.topic!r} does not belong to this consumer of {self.topic!r}"
            )

    def _lease(self, msg: Message) -> _Lease | None:
        self._check_topic(msg)
        return self._in_flight.get((msg.partition, msg.offset))

    def _ack_later(
        self, msgs: list[Message]
    ) -> tuple[list[tuple[Message, _Job]], _AckWrite | None, list[_Shared]]:
        """Queue the acks of the jobs this consumer holds: (mine, the write acking them, shared).

        `mine`: each message with the job this write acks; `shared`: messages
        whose ack is already on its way (acking twice at once is one ack, not
        a lost lease), with that write. Messages not held (acked before) are left out.
        """
        mine: list[tuple[Message, _Job]] = []
        shared: list[_Shared] = []
        jobs: list[_Job] = []
        leases: set[int] = set()
        topic, in_flight, acking = self.topic, self._in_flight, self._acking
        for m in msgs:
            if m.topic != topic:
                self._check_topic(m)
            key = (m.partition, m.offset)
            lease = in_flight.get(key)
            if lease is None:
                continue
            if acking:
                sharing = acking.get(key)
                if sharing is not None:
                    shared.append((m, lease[0], sharing))
                    continue
            job = (lease[0], key[1], lease[1])
            mine.append((m, job))
            jobs.append(job)
            if lease[2] is not None:
                leases.add(lease[2])
        if not jobs:
            return mine, None, shared
        future = self._writer.ack(jobs, leases)
        keys = [(m.partition, m.offset) for m, _ in mine]
        acking.update(dict.fromkeys(keys, future))
        future.add_done_callback(lambda f: self._acked(keys, f))
        return mine, future, shared

    def _acked(self, keys: list[tuple[str, int]], future: _AckWrite) -> None:
        """Bookkeeping once a write of acks committed (or failed: then the leases are kept, to retry or nack)."""
        acking, in_flight = self._acking, self._in_flight
        for key in keys:
            acking.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            return
        done = future.result()
        pids: set[int] = set()
        acked = 0
        for key in keys:
            lease = in_flight.pop(key, None)
            if lease is not None:
                pids.add(lease[0])
                acked += (lease[0], key[1]) in done
        _metrics.queue_acked(self.topic, acked)
        if self.ordered_by_key:
            # The keys' next jobs are free now; nobody publishes to say so.
            self._announce(pids)

    async def ack(self, msg: Message, result: Any = None) -> None:
        """Done: remove the job. LeaseLostError if it came back and another consumer took it meanwhile.

        Acking a message this consumer already acked is a no-op. Acks sent at
        the same time from several tasks go to the database in one statement.
        `result` (JSON-encodable): kept for the topic's result_ttl, for `b.job_result`.
        """
        if result is not None:
            await self._ack_with_result(msg, queue_features.encode_result(result))
        elif await self._ack([msg]):
            raise self._lost(msg, "ack")

    async def _ack_with_result(self, msg: Message, result: str) -> None:
        """One ack statement that also keeps the job's result and announces it."""
        key = (msg.partition, msg.offset)
        lease = self._lease(msg)
        if lease is None:
            return
        sharing = self._acking.get(key)
        if sharing is not None:  # a plain ack of it is on its way: that one answers
            await asyncio.shield(sharing)
            return
        with db.translate_errors():
            ok = await controls.ack_with_result(
                self._ctx.lender,
                lease[0],
                msg.offset,
                lease[1],
                result,
                self._ctx.channels.results,
                self._ctx.now(),
            )
        self._in_flight.pop(key, None)
        if not ok:
            raise self._lost(msg, "ack")
        _metrics.queue_acked(self.topic, 1)
        if self.ordered_by_key:
            self._announce({lease[0]})

    async def progress(self, msg: Message, data: Any) -> None:
        """Report a taken job's progress (JSON-encodable): kept with the job and renewing its lease.

        The lease runs `visibility_timeout` seconds from now again, so a long job that reports
        progress more often than that is not handed out to another consumer. `b.job_status`
        shows it. LeaseLostError if the job's lease ran out and another consumer took it.
        """
        from bus import job_features

        text = job_features.encode_progress(data)
        lease = self._lease(msg)
        if lease is None or (msg.partition, msg.offset) in self._acking:
            raise ValidationError(
                f"message {msg.partition}@{msg.offset} is not held by this consumer (already acked or nacked?)"
            )
        with db.translate_errors():
            ok = await job_sql.progress(
                self._ctx.lender,
                job_sql.ProgressParams(
                    partition_id=lease[0],
                    offset=msg.offset,
                    epoch=lease[1],
                    data=text,
                    consumer=self.consumer_id,
                    visibility_timeout=self.visibility_timeout,
                    now=self._ctx.now(),
                ),
            )
        if not ok:
            raise self._lost(msg, "progress")

    async def ack_many(self, msgs: list[Message]) -> None:
        """Ack several jobs in one statement; LeaseLostError (after acking the others) if any was lost."""
        lost = await self._ack(msgs)
        if lost:
            raise self._lost(lost[0], f"ack of {len(lost)} message(s), first")

    async def _ack(self, msgs: list[Message]) -> list[Message]:
        """Ack what this consumer holds of `msgs`; the messages whose lease was lost."""
        mine, write, shared = self._ack_later(msgs)
        lost: list[Message] = []
        # Shielded: an answer may be shared, and one caller giving up must not cancel it for the others.
        if write is not None:
            done = await asyncio.shield(write)
            lost = [m for m, job in mine if (job[0], job[1]) not in done]
        if shared:
            await asyncio.shield(asyncio.gather(*{f for _, _, f in shared}))
            lost += [m for m, pid, f in shared if (pid, m.offset) not in f.result()]
        return lost

    async def nack(self, msg: Message, delay: float | timedelta = 0.0, error: str | None = None) -> None:
        """Not done: back to the queue after `delay` seconds, `error` kept in its history.

        On its last attempt (`msg.attempt >= max_attempts`) the message goes to
        the dead-letter topic instead.
        """
        delay = validate_seconds(delay, "delay", allow_zero=True)
        reason = error if error is not None else "nacked"
        if not isinstance(reason, str):
            raise ValidationError("error must be a str (a short description of what went wrong)")
        lease = self._lease(msg)
        if lease is None or (msg.partition, msg.offset) in self._acking:
            raise ValidationError(
                f"message {msg.partition}@{msg.offset} is not held by this consumer (already acked or nacked?)"
            )
        pid, epoch, _ = lease
        del self._in_flight[(msg.partition, msg.offset)]
        with db.translate_errors():
            if msg.attempt >= self.max_attempts:
                async with self._ctx.pool.acquire() as conn, conn.transaction():
                    row = _DeadRow(
                        pid, msg.offset, epoch, msg.attempt, msg.partition, msg.key, msg.payload, msg.headers
                    )
                    moved = await self._dead_letter_rows(conn, [row], reason)
                if not moved:
                    raise self._lost(msg, "nack")
                if self.ordered_by_key:
                    self._announce({pid})
                return
            ok = await sql.nack(self._ctx.pool, pid, msg.offset, epoch, delay, reason, self._ctx.now())
            _metrics.queue_nacked(self.topic)
        if not ok:
            raise self._lost(msg, "nack")
        if delay == 0 or self.ordered_by_key:
            # Visible again now (or the key's next job is): wake whoever waits. A delayed job is
            # found by the waiters' sleep until the next visible job instead.
            self._announce({pid})

    async def _dead_letter_rows(self, conn: Connection, rows: list[_DeadRow], error: str | None) -> int:
        """Move jobs to the dead-letter topic (caller's transaction); how many were still ours.

        `error` is this attempt's failure (a nack); None when the rows come from
        a take, whose statement already recorded the expired timeout.
        """
        outgoing = []
        for r in rows:
            removed = await sql.delete_job(conn, r.partition_id, r.offset, r.lease_epoch)
            if removed is None:
                continue
            errors = _errors_decoder.decode(removed.errors) if removed.errors else []
            if error is not None:  # timed like the attempts the database recorded
                at = (self._ctx.now() or datetime.now(UTC)).isoformat()
                errors.append({"attempt": r.attempts, "error": error, "at": at})
            await controls.record(
                conn,
                r.partition_id,
                r.offset,
                self.topic,
                "failed",
                None,
                _encoder.encode(errors).decode(),
                self._ctx.channels.results,
                self._ctx.now(),
            )
            last_error = str(errors[-1].get("error", "")) if errors else "unknown"
            headers = dict(r.headers)
            headers.update(
                {
                    "dead_letter.topic": self.topic,
                    "dead_letter.partition": r.partition,
                    "dead_letter.offset": str(r.offset),
                    "dead_letter.attempts": str(min(r.attempts, self.max_attempts)),
                    "dead_letter.last_error": last_error,
                    "dead_letter.errors": _encoder.encode(errors).decode(),
                }
            )
            outgoing.append(Outgoing(r.payload if r.payload is not None else b"", key=r.key, headers=headers))
        if outgoing:
            # publish_many's annotation names a plain Connection; a pool's proxy behaves as one.
            await self._ctx.publish_many(
                self.dead_letter, outgoing, connection=cast("asyncpg.Connection", conn)
            )
            self._log.warning("dead_lettered", count=len(outgoing), dead_letter=self.dead_letter)
            _metrics.dead_lettered("", self.topic, len(outgoing))
        return len(outgoing)

    def _lost(self, msg: Message, what: str) -> LeaseLostError:
        return LeaseLostError(
            f"{what} of {self.topic}/{msg.partition}@{msg.offset} refused: its visibility timeout ran out and "
            "another consumer took it (or it was dead-lettered); nothing was applied. Use a longer "
            "visibility_timeout for slow jobs"
        )
