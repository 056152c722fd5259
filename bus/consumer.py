"""Consumer groups for users: the poll-style Consumer and the handler-style Subscription.

Both are thin: the actors (Coordinator, PartitionWorkers, Rebalancer,
HeartbeatMonitor) do the work. A Consumer is the Sink its workers hand
batches to: a bounded buffer (a slow consumer slows fetching; memory stays
flat), plus the positions the user has polled through, which `commit()`
writes fenced by each partition's lease epoch.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg

from actors import metrics as _metrics
from actors.coordinator import MemberSpec
from actors.messages import Rewind, Seek, Wake
from actors.runtime import ActorStoppedError
from actors.worker import Batch, RetryPolicy
from bus.codec import messages_from_rows
from bus.start import parse_start
from bus.types import Message, Outgoing, TopicPartition
from storage import db, leases
from storage import groups as group_sql
from storage.errors import (
    BusError,
    StaleGenerationError,
    StorageUnavailableError,
    TopicNotFoundError,
    ValidationError,
)
from storage.logs import get_logger
from storage.names import validate_name, validate_offset

if TYPE_CHECKING:
    from bus.client import Bus

log = get_logger(__name__)

Callback = Callable[[set[TopicPartition]], Awaitable[None] | None]


@dataclass(frozen=True)
class Retry:
    """Handler retries: `max_attempts` in all, waiting `backoff` seconds, doubling, up to `max_backoff`."""

    max_attempts: int = 3
    backoff: float = 0.5
    max_backoff: float = 30.0

    def policy(self) -> RetryPolicy:
        if self.max_attempts < 1 or self.backoff < 0:
            raise ValidationError("Retry needs max_attempts >= 1 and backoff >= 0")
        return RetryPolicy(self.max_attempts, self.backoff, self.max_backoff)


def _validate_topics(topics: Any, namespace: str | None, task: str | None) -> tuple[str, ...]:
    if topics is None:
        if namespace is None and task is None:
            raise ValidationError(
                "name the topics to read (topics=[...]) or a label (namespace=... / task=...)"
            )
        return ()
    if not isinstance(topics, (list, tuple)) or not all(isinstance(t, str) for t in topics):
        raise ValidationError("topics must be a list of topic names")
    if not topics:
        raise ValidationError("topics is empty: name at least one topic")
    return tuple(validate_name(t, "topic name") for t in topics)


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


@dataclass
class _Member:
    """The group settings a Consumer or Subscription joins with."""

    group: str
    topics: tuple[str, ...]
    namespace: str | None
    task: str | None
    start: Any
    assignor: str
    instance_id: str | None
    fetch_size: int


async def _join_group(b: Bus, m: _Member) -> None:
    """Record the group (its start: first subscriber wins) and the topics it reads."""
    spec = parse_start(m.start, b.config.default_start)
    for t in m.topics:
        await b.topic(t)  # TopicNotFoundError before anything is written
    with db.translate_errors():
        async with b.pool.acquire() as conn, conn.transaction():
            await group_sql.record_group(
                conn,
                m.group,
                start_mode=spec.start_mode,
                start_time=spec.start_time,
                start_offsets_json=spec.start_offsets_json,
                lookback_seconds=b.config.lookback,
                assignor=m.assignor,
                namespace=m.namespace,
                task=m.task,
            )
            if m.topics:
                await group_sql.add_group_topics(conn, m.group, list(m.topics))
            else:
                await group_sql.add_matching_topics(conn, m.group)


def _member_spec(b: Bus, m: _Member) -> MemberSpec:
    c = b.config
    return MemberSpec(
        group=m.group,
        topics=m.topics,
        instance_id=m.instance_id,
        client_id=f"{os.getpid()}-{id(b):x}",
        session_timeout=c.session_timeout,
        rebalance_delay=c.rebalance_delay,
        lease_time=c.lease_time,
        poll_interval=c.max_poll_interval,
        fetch_size=m.fetch_size,
        groups_channel=b.channels.groups,
        messages_channel=b.channels.messages,
    )


#: PostgreSQL's default search_path: a transaction() connection sees the caller's tables.
USER_SEARCH_PATH = '"$user", public'


@dataclass(frozen=True)
class ConsumerTransaction:
    """The open transaction of `Consumer.transaction()`: write through `connection`."""

    connection: asyncpg.Connection


class _MemberBase:
    """What Consumer and Subscription share: joining, the Coordinator, callbacks."""

    handler_mode = False
    retry = RetryPolicy()

    def __init__(
        self, b: Bus, member: _Member, on_assign: Callback | None, on_revoke: Callback | None
    ) -> None:
        from actors.assignors import ASSIGNORS

        self._bus = b
        self._m = member
        validate_name(member.group, "group name")
        if member.assignor not in ASSIGNORS:
            raise ValidationError(f"assignor must be one of {ASSIGNORS}, not {member.assignor!r}")
        if member.instance_id is not None:
            validate_name(member.instance_id, "instance_id")
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._coordinator: Any = None
        self._assignment: dict[TopicPartition, int] = {}
        self.member_id: str | None = None
        self.generation: int = -1
        self.errors: list[str] = []
        self.has_error = asyncio.Event()
        self._assigned_event = asyncio.Event()

    @property
    def group(self) -> str:
        return self._m.group

    async def _start_member(self) -> None:
        if self._coordinator is not None:
            return
        await _join_group(self._bus, self._m)
        system = await self._bus._group_system()
        self._coordinator = system.spawn_member(_member_spec(self._bus, self._m), self)

    async def _stop_member(self) -> None:
        if self._coordinator is not None:
            ref, self._coordinator = self._coordinator, None
            await ref.stop(drain=False)

    def assignment(self) -> set[TopicPartition]:
        """The partitions this member owns now (sync)."""
        return set(self._assignment)

    async def wait_assigned(self, timeout: float = 30.0) -> set[TopicPartition]:  # noqa: ASYNC109
        """Wait until this member has been given at least one partition (useful in tests and startup)."""
        await asyncio.wait_for(self._assigned_event.wait(), timeout)
        return self.assignment()

    # -- the Sink side (called by this member's actors, on the event loop) -----------

    def on_member(self, member_id: str, generation: int) -> None:
        self.member_id = member_id
        self.generation = generation

    def on_error(self, error: str) -> None:
        self.errors.append(error)
        self.has_error.set()

    async def on_assign(self, partitions: set[tuple[str, str]]) -> None:
        tps = {TopicPartition(t, p) for t, p in partitions}
        for tp in tps:
            self._assignment[tp] = 0
        if tps:
            self._assigned_event.set()
        if self._on_assign is not None and tps:
            await _maybe_await(self._on_assign(tps))

    async def on_revoke(self, partitions: set[tuple[str, str]]) -> None:
        tps = {TopicPartition(t, p) for t, p in partitions}
        if self._on_revoke is not None and tps:
            await _maybe_await(self._on_revoke(tps))
        for tp in tps:
            self._assignment.pop(tp, None)
        if not self._assignment:
            self._assigned_event.clear()

    def failed_partition(self, topic: str, partition: str, error: BaseException) -> None:
        self.on_error(f"{topic}/{partition}: {error!r}")


class Consumer(_MemberBase):
    """A poll-style group member (aiokafka's shape): `async with`, `poll`, `async for`, `commit`."""

    def __init__(
        self,
        b: Bus,
        group: str,
        *,
        topics: list[str] | None = None,
        namespace: str | None = None,
        task: str | None = None,
        start: Any = None,
        auto_commit: bool = True,
        max_poll_records: int = 500,
        assignor: str = "range",
        instance_id: str | None = None,
        on_assign: Callback | None = None,
        on_revoke: Callback | None = None,
        buffer_size: int | None = None,
    ) -> None:
        if (
            isinstance(max_poll_records, bool)
            or not isinstance(max_poll_records, int)
            or not 1 <= max_poll_records <= 100_000
        ):
            raise ValidationError("max_poll_records must be an integer from 1 to 100000")
        topic_list = _validate_topics(topics, namespace, task)
        if namespace is not None:
            validate_name(namespace, "namespace")
        if task is not None:
            validate_name(task, "task")
        parse_start(start, b.config.default_start)  # validate before anything is written
        super().__init__(
            b,
            _Member(
                group, topic_list, namespace, task, start, assignor, instance_id, min(max_poll_records, 1000)
            ),
            on_assign,
            on_revoke,
        )
        self.auto_commit = auto_commit
        self.max_poll_records = max_poll_records
        # Room for a few fetches of several partitions at once, so fetching overlaps the user's work.
        self._capacity = buffer_size or max(4 * max_poll_records, 2000)
        self._buffer: deque[tuple[Batch, int]] = deque()  # (batch, index of next row)
        self._buffered = 0
        self._ready = asyncio.Event()
        # partition id -> (epoch, next offset) the user has been given / known committed /
        # sent inside a caller's transaction whose outcome this consumer cannot see.
        self._polled: dict[int, tuple[int, int]] = {}
        self._committed: dict[int, tuple[int, int]] = {}
        self._unconfirmed: dict[int, tuple[int, int]] = {}
        # Partitions that left this member while positions polled from them were not
        # committed: the next commit reports them (StaleGenerationError, nothing applied).
        self._moved: dict[int, TopicPartition] = {}
        # A failed transaction() left positions past the committed offsets: poll() rewinds first.
        self._must_rewind = False
        self._in_transaction = False
        self._tp_of: dict[int, TopicPartition] = {}
        self._workers: dict[int, Any] = {}
        self._worker_epoch: dict[int, int] = {}
        self._closed = False
        # Workers whose batch did not fit: poll() wakes them once it made room,
        # instead of leaving them idle until their next poll-fallback tick.
        self._refused: dict[int, Any] = {}
        # partition id -> the worker being revoked (on_revoke has run or is running):
        # poll() hands out nothing more of its batches (see on_revoke).
        self._revoking: dict[int, Any] = {}

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> Consumer:
        """Join the group (records its start if the group is new)."""
        await self._start_member()
        return self

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, cancel: bool = False) -> None:
        """Leave the group: commit (when auto_commit) what it still owns, release, leave.

        `cancel=True` also marks the group "cancelled" when no other member is
        live, so it stops holding retention back.
        """
        if self._closed:
            return
        self._closed = True
        await self._stop_member()
        if cancel:
            async with self._bus.pool.acquire() as conn:
                await group_sql.cancel_group(conn, self.group)

    # -- the Sink side -------------------------------------------------------------

    def offer(self, batch: Batch) -> bool:
        if batch.partition_id in self._revoking:
            if self._revoking[batch.partition_id] is batch.worker:
                return False  # being revoked: the worker drops it when it stops
            del self._revoking[batch.partition_id]  # a new worker: the partition came back
        if self._buffered and self._buffered + len(batch.rows) > self._capacity:
            self._refused[batch.partition_id] = batch.worker
            return False
        self._buffer.append((batch, 0))
        self._buffered += len(batch.rows)
        self._tp_of[batch.partition_id] = TopicPartition(batch.topic, batch.partition)
        self._workers[batch.partition_id] = batch.worker
        self._worker_epoch[batch.partition_id] = batch.epoch
        self._ready.set()
        return True

    def consumed(self, partition_id: int, epoch: int) -> int | None:
        # Inside an open transaction() the positions belong to the caller's
        # transaction: committing them outside it could lose what it rolls back.
        if not self.auto_commit or self._in_transaction:
            return None
        polled = self._polled.get(partition_id)
        if polled is None or polled[0] != epoch:
            return None
        return polled[1]

    async def on_revoke(self, partitions: set[tuple[str, str]]) -> None:
        """Kafka's contract for a clean revoke: the user's on_revoke is the last word on these partitions.

        Before it runs, whatever is buffered from them is dropped and their
        workers' further batches are refused, so nothing polled after the
        callback's commit can belong to a partition that is leaving. A commit
        inside the callback still applies (the leases are held until it
        returns); positions it leaves uncommitted are reported by the next
        commit() (see `released`).
        """
        tps = {TopicPartition(t, p) for t, p in partitions}
        pids = {pid for pid, tp in self._tp_of.items() if tp in tps}
        for pid in pids:
            self._revoking[pid] = self._workers.get(pid)
            self._drop_buffered(pid, None)
        await super().on_revoke(partitions)

    def released(self, partition_id: int, epoch: int, committed: int | None) -> None:
        """The lease of `partition_id` ended (revoked, lost, or this consumer closing).

        A position polled under that lease and not known to be committed
        (here, by the worker as it let go, or sent inside a caller's
        transaction) is a move: the new owner reads those messages again, so
        the next commit() raises StaleGenerationError and applies nothing,
        with or without an on_revoke callback. Either way the partition's
        positions are forgotten: a later commit never re-sends them.
        """
        polled = self._polled.get(partition_id)
        if polled is not None and polled[0] == epoch:
            settled = (
                committed == polled[1]
                or self._committed.get(partition_id) == polled
                or self._unconfirmed.get(partition_id) == polled
            )
            if not settled:
                self._moved[partition_id] = self._tp_of.get(
                    partition_id, TopicPartition("?", str(partition_id))
                )
            for table in (self._polled, self._committed, self._unconfirmed):
                table.pop(partition_id, None)
        if self._worker_epoch.get(partition_id) == epoch:
            self._workers.pop(partition_id, None)
            self._worker_epoch.pop(partition_id, None)

    def _drop_buffered(self, partition_id: int, epoch: int | None) -> None:
        """Drop buffered batches of a partition (of one lease epoch, or of any when None)."""
        kept: deque[tuple[Batch, int]] = deque()
        for batch, index in self._buffer:
            if batch.partition_id == partition_id and (epoch is None or batch.epoch == epoch):
                self._buffered -= len(batch.rows) - index
            else:
                kept.append((batch, index))
        self._buffer = kept

    def revoked(self, partition_id: int, epoch: int) -> None:
        self._drop_buffered(partition_id, epoch)

    async def handle(self, topic: str, partition: str, row: asyncpg.Record, attempt: int) -> None:
        raise RuntimeError("a poll consumer has no handler")

    async def dead_letter(
        self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int
    ) -> bool:
        return False

    def failed(self, topic: str, partition: str, error: BaseException) -> None:
        self.failed_partition(topic, partition, error)

    # -- consuming -----------------------------------------------------------------

    async def poll(self, timeout: float = 1.0, max_records: int | None = None) -> list[Message]:  # noqa: ASYNC109
        """Up to `max_records` (default max_poll_records) messages, waiting at most `timeout` seconds.

        With auto_commit, the positions of the previous poll are committed first.
        """
        if self._coordinator is None:
            raise BusError("the consumer is not started: use `async with b.consumer(...) as c:`")
        if self._must_rewind:
            await self.rewind()
        if self.auto_commit and not self._in_transaction:
            try:
                await self.commit()
            except StaleGenerationError as exc:
                log.info(
                    "auto_commit_skipped",
                    group=self.group,
                    member=self.member_id,
                    generation=self.generation,
                    reason=str(exc),
                )
        limit = max_records or self.max_poll_records
        deadline = time.monotonic() + max(0.0, timeout)
        while not self._buffer:
            self._ready.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(self._ready.wait(), remaining)
            except TimeoutError:
                return []
        out: list[Message] = []
        while self._buffer and len(out) < limit:
            batch, index = self._buffer.popleft()
            take = batch.rows[index : index + (limit - len(out))]
            out.extend(messages_from_rows(batch.topic, batch.partition, take))
            self._buffered -= len(take)
            _metrics.consumed(self.group, batch.topic, len(take))
            self._polled[batch.partition_id] = (batch.epoch, take[-1]["offset"] + 1)
            if index + len(take) < len(batch.rows):
                self._buffer.appendleft((batch, index + len(take)))
        if out and self._refused:
            refused, self._refused = self._refused, {}
            for worker in refused.values():
                worker.signal(Wake())
        return out

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while not self._closed:
            for m in await self.poll(timeout=self._bus.config.max_poll_interval):
                yield m

    async def commit(self, connection: asyncpg.Connection | None = None) -> None:
        """Commit the positions of everything polled so far, all or nothing.

        Raises StaleGenerationError (and applies nothing) if any of those
        partitions moved to another member since it was polled; each move is
        reported once. A position already committed is never a move.

        With `connection`, the commit runs inside the caller's open transaction:
        the handler's own writes and the offsets commit (or roll back) together,
        which makes processing effectively-once (invariant 5). If it raises, or
        the caller's transaction rolls back after it, call `await c.rewind()`
        before polling again. `async with c.transaction() as tx:` does all of
        that for you.
        """
        if connection is not None:
            with db.translate_errors():
                async with db.on_schema(connection, self._bus.config.schema), connection.transaction():
                    sent = await self._commit_on(connection)
            # The caller may still roll back: remembered as sent, not as committed.
            # A later commit re-sends it harmlessly, and never takes it for a move.
            self._unconfirmed.update({pid: (epoch, offset) for pid, offset, epoch in sent})
            return
        # One statement, all or nothing: no transaction block needed.
        with db.translate_errors(), db.internal():
            async with self._bus.pool.acquire() as conn:
                sent = await self._commit_on(conn)
        self._confirm(sent)

    def _confirm(self, sent: list[tuple[int, int, int]]) -> None:
        for pid, offset, epoch in sent:
            self._committed[pid] = (epoch, offset)
            self._unconfirmed.pop(pid, None)

    def _pending(self) -> list[tuple[int, int, int]]:
        return [
            (pid, offset, epoch)
            for pid, (epoch, offset) in self._polled.items()
            if self._committed.get(pid) != (epoch, offset)
        ]

    def _raise_moved(self, moved: list[str]) -> None:
        raise StaleGenerationError(
            f"group {self.group!r} moved on: partition(s) {', '.join(sorted(moved))} are no longer owned by "
            f"member {self.member_id} (rebalanced or lease lost); nothing was committed, their new "
            "owner will read those messages again; call `await c.rewind()` (transaction() does) and poll again"
        )

    async def _commit_on(self, conn: asyncpg.Connection) -> list[tuple[int, int, int]]:
        """Write the pending positions on `conn`, all or nothing; what was written. Raises on a move."""
        if self._moved:
            moved, self._moved = self._moved, {}
            self._raise_moved([str(tp) for tp in moved.values()])
        pending = self._pending()
        if self.member_id is None:
            return []
        while pending:
            applied, gone = await leases.commit_all(conn, self.group, self.member_id, pending)
            if applied:
                return pending
            # A position sent earlier inside a caller's transaction that did commit
            # is not a move: the partition left since, its offset is already there.
            entry = {pid: (epoch, offset) for pid, offset, epoch in pending}
            resent = {
                pid
                for pid, stored in gone.items()
                if self._unconfirmed.get(pid) == entry[pid] and stored >= entry[pid][1]
            }
            for pid in resent:
                for table in (self._polled, self._committed, self._unconfirmed):
                    table.pop(pid, None)
            lost = set(gone) - resent
            if lost:
                # Report a move once; its new owner re-reads those messages. Nothing applied.
                for pid in lost:
                    self._polled.pop(pid, None)
                    self._unconfirmed.pop(pid, None)
                self._raise_moved([str(self._tp_of.get(p, p)) for p in lost])
            pending = [e for e in pending if e[0] not in resent]
        return []

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[ConsumerTransaction]:
        """Effectively-once: the caller's writes and the offsets of what it polls inside commit together.

        `tx.connection` is a pool connection in an open transaction, with
        PostgreSQL's default search_path (your tables, not the bus's). Leaving
        the block without an error commits the writes and the fenced offsets
        in that one transaction. On any error (StaleGenerationError from the
        offsets, or your own) everything rolls back and every partition this
        member still owns is rewound to its committed offset, so the batch
        comes again; partitions that moved go to their new owner from the
        committed offset. Nothing is lost, nothing applies twice.
        """
        if self._coordinator is None:
            raise BusError("the consumer is not started: use `async with b.consumer(...) as c:`")
        if self._in_transaction:
            raise BusError("a transaction is already open on this consumer: finish it before opening another")
        if self._must_rewind:
            await self.rewind()
        with db.translate_errors():
            conn_cm = self._bus.pool.acquire()
            conn = await conn_cm.__aenter__()
        try:
            tx = conn.transaction()
            self._in_transaction = True
            try:
                with db.translate_errors():
                    await tx.start()
                    await conn.execute(db.SET_LOCAL_SEARCH_PATH, USER_SEARCH_PATH)
                yield ConsumerTransaction(conn)
                with db.translate_errors():
                    async with db.on_schema(conn, self._bus.config.schema):
                        sent = await self._commit_on(conn)
                    await tx.commit()
            except BaseException:
                self._in_transaction = False
                self._must_rewind = True
                try:
                    await tx.rollback()
                except Exception:  # the connection is gone: the server rolled back
                    pass
                try:
                    await self.rewind()
                except Exception as exc:
                    # poll() rewinds first while this stays set.
                    log.warning("rewind_failed", group=self.group, member=self.member_id, error=repr(exc))
                raise
            self._in_transaction = False
            self._confirm(sent)
        finally:
            await conn_cm.__aexit__(None, None, None)

    async def rewind(self) -> None:
        """Sync positions back to the committed offsets of every owned partition.

        Everything polled and not committed comes again (buffered messages are
        dropped); partitions that moved are forgotten (their new owner reads
        from the committed offset). Call it after a `commit(connection=...)`
        raised or its transaction rolled back.
        """
        self._must_rewind = True
        self._moved.clear()
        for table in (self._polled, self._committed, self._unconfirmed):
            table.clear()
        self._buffer.clear()
        self._buffered = 0
        for pid, worker in list(self._workers.items()):
            if worker is None:
                continue
            try:
                done = await worker.ask(Rewind(), timeout=30.0)
            except ActorStoppedError:
                continue  # the partition left: its next owner starts from the committed offset
            if not done:
                raise StorageUnavailableError(
                    f"could not read the committed offset of {self._tp_of.get(pid, pid)}; "
                    "PostgreSQL is unavailable: retry (poll() rewinds first)"
                )
        self._must_rewind = False

    def commit_async(self) -> asyncio.Task[None]:
        """Commit in the background; the task raises what `commit()` would."""
        return asyncio.get_running_loop().create_task(self.commit())

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """Continue partition `tp` from `offset` (it must be assigned to this consumer)."""
        validate_offset(offset)
        if tp not in self._assignment:
            raise ValidationError(
                f"{tp} is not assigned to this consumer (assignment: {sorted(self._assignment)})"
            )
        pid = next((p for p, t in self._tp_of.items() if t == tp), None)
        worker = self._workers.get(pid) if pid is not None else None
        if worker is None:
            info = await self._bus.topic(tp.topic)
            pid = await self._bus.partition_id(info, tp.partition, create=False)
            worker = None
        if pid is not None:
            kept: deque[tuple[Batch, int]] = deque()
            for batch, index in self._buffer:
                if batch.partition_id == pid:
                    self._buffered -= len(batch.rows) - index
                else:
                    kept.append((batch, index))
            self._buffer = kept
            self._polled.pop(pid, None)
        if worker is not None:
            await worker.ask(Seek(offset), timeout=30.0)  # answered once nothing older can be polled
        else:
            raise BusError(f"{tp} has no running worker yet; retry after the first poll")


class Subscription(_MemberBase):
    """A handler-style group member: the actors call `handler(message)` per message,
    partitions concurrently, in order within each."""

    handler_mode = True

    def __init__(
        self,
        b: Bus,
        group: str,
        handler: Callable[[Message], Awaitable[Any]],
        *,
        topics: list[str] | None = None,
        namespace: str | None = None,
        task: str | None = None,
        start: Any = None,
        retry: Retry | None = None,
        dead_letter: str | None = None,
        assignor: str = "range",
        instance_id: str | None = None,
        batch_size: int = 100,
        on_assign: Callback | None = None,
        on_revoke: Callback | None = None,
    ) -> None:
        if not callable(handler):
            raise ValidationError("handler must be an async callable taking a bus.Message")
        topic_list = _validate_topics(topics, namespace, task)
        if dead_letter is not None:
            validate_name(dead_letter, "dead_letter topic")
        parse_start(start, b.config.default_start)
        super().__init__(
            b,
            _Member(group, topic_list, namespace, task, start, assignor, instance_id, batch_size),
            on_assign,
            on_revoke,
        )
        self.handler = handler
        self.retry = (retry or Retry()).policy()
        self.dead_letter_topic = dead_letter
        self.processed = 0
        self.dead_lettered = 0

    async def start(self) -> Subscription:
        await self._start_member()
        return self

    async def stop(self) -> None:
        """Stop handling: commit, release, leave the group."""
        await self._stop_member()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the Sink side -------------------------------------------------------------

    def offer(self, batch: Batch) -> bool:
        raise RuntimeError("a subscription handles messages itself")

    def consumed(self, partition_id: int, epoch: int) -> int | None:
        return None

    def revoked(self, partition_id: int, epoch: int) -> None:
        return None

    async def handle(self, topic: str, partition: str, row: asyncpg.Record, attempt: int) -> None:
        from bus.client import to_message

        await self.handler(to_message(topic, partition, row, attempt))
        self.processed += 1
        _metrics.consumed(self.group, topic)

    async def dead_letter(
        self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int
    ) -> bool:
        if self.dead_letter_topic is None:
            return False
        from bus.client import to_message

        b = self._bus
        try:
            await b.topic(self.dead_letter_topic)
        except TopicNotFoundError:
            await b.create_topic(self.dead_letter_topic, partitions=None)
        m = to_message(topic, partition, row, attempts)
        headers = dict(m.headers)
        headers.update(
            {
                "bus.error": repr(error)[:2000],
                "bus.attempts": str(attempts),
                "bus.source.topic": topic,
                "bus.source.partition": partition,
                "bus.source.offset": str(m.offset),
                "bus.group": self.group,
            }
        )
        info = await b.topic(self.dead_letter_topic)
        out_partition = partition if info.dynamic else None
        await b.publish_many(
            self.dead_letter_topic,
            [
                Outgoing(
                    m.payload if m.payload is not None else b"",
                    key=m.key,
                    partition=out_partition,
                    headers=headers,
                )
            ],
        )
        self.dead_lettered += 1
        return True

    def failed(self, topic: str, partition: str, error: BaseException) -> None:
        self.failed_partition(topic, partition, error)
