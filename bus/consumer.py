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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg

from actors import metrics as _metrics
from actors.coordinator import MemberSpec
from actors.messages import Seek, Wake
from actors.worker import Batch, RetryPolicy
from bus.start import parse_start
from bus.types import Message, Outgoing, TopicPartition
from storage import db, leases
from storage import groups as group_sql
from storage.errors import (
    BusError,
    StaleGenerationError,
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
            raise ValidationError("name the topics to read (topics=[...]) or a label (namespace=... / task=...)")
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


class _MemberBase:
    """What Consumer and Subscription share: joining, the Coordinator, callbacks."""

    handler_mode = False
    retry = RetryPolicy()

    def __init__(self, b: Bus, member: _Member, on_assign: Callback | None, on_revoke: Callback | None) -> None:
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
        if isinstance(max_poll_records, bool) or not isinstance(max_poll_records, int) or not 1 <= max_poll_records <= 100_000:
            raise ValidationError("max_poll_records must be an integer from 1 to 100000")
        topic_list = _validate_topics(topics, namespace, task)
        if namespace is not None:
            validate_name(namespace, "namespace")
        if task is not None:
            validate_name(task, "task")
        parse_start(start, b.config.default_start)  # validate before anything is written
        super().__init__(
            b,
            _Member(group, topic_list, namespace, task, start, assignor, instance_id, min(max_poll_records, 1000)),
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
        # partition id -> (epoch, next offset) the user has been given / last committed
        self._polled: dict[int, tuple[int, int]] = {}
        self._committed: dict[int, tuple[int, int]] = {}
        self._tp_of: dict[int, TopicPartition] = {}
        self._workers: dict[int, Any] = {}
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
        self._ready.set()
        return True

    def consumed(self, partition_id: int, epoch: int) -> int | None:
        if not self.auto_commit:
            return None
        polled = self._polled.get(partition_id)
        if polled is None or polled[0] != epoch:
            return None
        return polled[1]

    async def on_revoke(self, partitions: set[tuple[str, str]]) -> None:
        """Kafka's contract for a clean revoke: the user's on_revoke is the last word on these partitions.

        Before it runs, whatever is buffered from them is dropped and their
        workers' further batches are refused, so nothing polled after the
        callback's commit can belong to a partition that is leaving (its
        commit would be refused and the new owner would read it again).

        A move is reported once. Without auto_commit and with a user
        on_revoke, the callback is that report: after it, the partitions'
        polled positions are forgotten, so a later commit() neither reports
        them again nor fails on them (all or nothing would otherwise let one
        stale entry refuse the commits of partitions still held, the next
        on_revoke's included). Without a callback, the next commit() reports
        the move (StaleGenerationError, nothing applied). With auto_commit the
        worker commits the polled position as it stops (see `consumed`).
        """
        tps = {TopicPartition(t, p) for t, p in partitions}
        pids = {pid for pid, tp in self._tp_of.items() if tp in tps}
        for pid in pids:
            self._revoking[pid] = self._workers.get(pid)
            self._drop_buffered(pid, None)
        try:
            await super().on_revoke(partitions)
        finally:
            if not self.auto_commit and self._on_revoke is not None:
                for pid in pids:
                    self._polled.pop(pid, None)
                    self._committed.pop(pid, None)

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
        # With auto_commit the worker committed this position on revoke; without
        # it, the position stays so that a later commit() reports the move.
        if self.auto_commit:
            for table in (self._polled, self._committed):
                if partition_id in table and table[partition_id][0] == epoch:
                    del table[partition_id]
        self._workers.pop(partition_id, None)

    async def handle(self, topic: str, partition: str, row: asyncpg.Record, attempt: int) -> None:
        raise RuntimeError("a poll consumer has no handler")

    async def dead_letter(self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int) -> bool:
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
        if self.auto_commit:
            try:
                await self.commit()
            except StaleGenerationError as exc:
                log.info("auto_commit_skipped", group=self.group, member=self.member_id, generation=self.generation, reason=str(exc))
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
        from bus.client import to_message

        while self._buffer and len(out) < limit:
            batch, index = self._buffer.popleft()
            take = batch.rows[index : index + (limit - len(out))]
            out.extend(to_message(batch.topic, batch.partition, r) for r in take)
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
        partitions moved to another member since it was polled.

        With `connection`, the commit runs inside the caller's open transaction:
        the handler's own writes and the offsets commit (or roll back) together,
        which makes processing effectively-once (invariant 5).
        """
        pending = [
            (pid, offset, epoch)
            for pid, (epoch, offset) in self._polled.items()
            if self._committed.get(pid) != (epoch, offset)
        ]
        if not pending or self.member_id is None:
            return
        if connection is not None:
            with db.translate_errors():
                async with db.on_schema(connection, self._bus.config.schema), connection.transaction():
                    await self._commit_on(connection, pending)
            # Not remembered as committed: the caller may still roll back; a
            # later commit re-sends it (committing is idempotent, never backwards).
            return
        with db.translate_errors():
            async with self._bus.pool.acquire() as conn, conn.transaction():
                await self._commit_on(conn, pending)
        for pid, offset, epoch in pending:
            self._committed[pid] = (epoch, offset)

    async def _commit_on(self, conn: asyncpg.Connection, pending: list[tuple[int, int, int]]) -> None:
        assert self.member_id is not None
        applied = await leases.commit(conn, self.group, self.member_id, pending)
        missing = {pid for pid, _, _ in pending} - applied
        if missing:
            moved = sorted(str(self._tp_of.get(p, p)) for p in missing)
            # Report a moved partition once; its new owner re-reads those messages.
            for pid in missing:
                self._polled.pop(pid, None)
            # Raising rolls the whole transaction back: nothing applies.
            raise StaleGenerationError(
                f"group {self.group!r} moved on: partition(s) {', '.join(moved)} are no longer owned by "
                f"member {self.member_id} (rebalanced or lease lost); nothing was committed, their new "
                "owner will read those messages again"
            )

    def commit_async(self) -> asyncio.Task[None]:
        """Commit in the background; the task raises what `commit()` would."""
        return asyncio.get_running_loop().create_task(self.commit())

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """Continue partition `tp` from `offset` (it must be assigned to this consumer)."""
        validate_offset(offset)
        if tp not in self._assignment:
            raise ValidationError(f"{tp} is not assigned to this consumer (assignment: {sorted(self._assignment)})")
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
            await worker.tell(Seek(offset))
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
            b, _Member(group, topic_list, namespace, task, start, assignor, instance_id, batch_size), on_assign, on_revoke
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

    async def dead_letter(self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int) -> bool:
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
            self.dead_letter_topic, [Outgoing(m.payload if m.payload is not None else b"", key=m.key, partition=out_partition, headers=headers)]
        )
        self.dead_lettered += 1
        return True

    def failed(self, topic: str, partition: str, error: BaseException) -> None:
        self.failed_partition(topic, partition, error)

