"""The hand-off between a member's actors and the user-facing Consumer / Subscription.

The Coordinator and its PartitionWorkers talk to a member through a Sink
(`actors.worker.Sink`, `actors.coordinator.MemberSink`): batches offered,
partitions assigned, revoked and released, handlers run. These objects are
that Sink, so the public classes expose only what users call.

`PollHandoff` is the poll consumer's bounded channel: batches queue here
(a slow consumer slows fetching; memory stays flat), and it keeps the
positions the user has polled through, committed, or sent inside a caller's
transaction, which `Consumer.commit()` writes. Everything runs on the event
loop of the member's actors; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import asyncpg
import msgspec

from actors import metrics as _metrics
from actors.messages import Wake, WorkerMessage
from actors.runtime import ActorRef
from actors.worker import Batch, RetryPolicy, TxOutcome, WorkerSpec
from bus import tracing
from bus.codec import messages_from_rows
from bus.transaction import USER_SEARCH_PATH, Retries, Transaction, dead_letter_outgoing, dead_letter_topic
from bus.types import Message, TopicPartition
from storage import db, leases

if TYPE_CHECKING:
    from datetime import datetime

    from bus.context import BusContext
    from bus.types import TopicInfo

Callback = Callable[[set[TopicPartition]], Awaitable[None] | None]
#: (epoch, next offset) of one partition
Position = tuple[int, int]


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


class MemberState:
    """What a member's actors tell it: identity, assignment, errors; the user's rebalance callbacks."""

    handler_mode = False
    transactional = False
    retry = RetryPolicy()

    def __init__(self, group: str, on_assign: Callback | None, on_revoke: Callback | None) -> None:
        self.group = group
        self.on_assign_callback = on_assign
        self.on_revoke_callback = on_revoke
        self.assignment: set[TopicPartition] = set()
        self.assigned = asyncio.Event()
        self.member_id: str | None = None
        self.joined = asyncio.Event()
        self.generation = -1
        self.errors: list[str] = []
        self.has_error = asyncio.Event()

    def on_member(self, member_id: str, generation: int) -> None:
        self.member_id = member_id
        self.generation = generation

    def on_joined(self, member_id: str) -> None:
        """The member's row is in the group (its id known; partitions come with the next generation)."""
        self.member_id = member_id
        self.joined.set()

    def on_error(self, error: str) -> None:
        self.errors.append(error)
        self.has_error.set()

    async def on_assign(self, partitions: set[tuple[str, str]]) -> None:
        tps = {TopicPartition(t, p) for t, p in partitions}
        self.assignment |= tps
        if tps:
            self.assigned.set()
        if self.on_assign_callback is not None and tps:
            await _maybe_await(self.on_assign_callback(tps))

    async def on_revoke(self, partitions: set[tuple[str, str]]) -> None:
        tps = {TopicPartition(t, p) for t, p in partitions}
        if self.on_revoke_callback is not None and tps:
            await _maybe_await(self.on_revoke_callback(tps))
        self.assignment -= tps
        if not self.assignment:
            self.assigned.clear()

    def failed(self, topic: str, partition: str, error: BaseException) -> None:
        self.on_error(f"{topic}/{partition}: {error!r}")

    async def handle_transaction(
        self, spec: WorkerSpec, epoch: int, rows: list[asyncpg.Record], now: datetime | None
    ) -> TxOutcome:
        raise RuntimeError("only a transactional subscription handles messages in a transaction")


class PollHandoff(MemberState):
    """The poll consumer's side of the hand-off: a bounded buffer of batches and the positions."""

    def __init__(
        self,
        group: str,
        on_assign: Callback | None,
        on_revoke: Callback | None,
        *,
        capacity: int,
        auto_commit: bool,
    ) -> None:
        super().__init__(group, on_assign, on_revoke)
        self.capacity = capacity
        self.auto_commit = auto_commit
        self.buffer: deque[tuple[Batch, int]] = deque()  # (batch, index of its next row)
        self.buffered = 0
        self.ready = asyncio.Event()
        # partition id -> position the user has been given / known committed / sent
        # inside a caller's transaction whose outcome this consumer cannot see.
        self.polled: dict[int, Position] = {}
        self.committed: dict[int, Position] = {}
        self.unconfirmed: dict[int, Position] = {}
        # Partitions that left this member while positions polled from them were not
        # committed: the next commit reports them (StaleGenerationError, nothing applied).
        self.moved: dict[int, TopicPartition] = {}
        # While a Consumer.transaction() is open its positions belong to that transaction.
        self.in_transaction = False
        self.tp_of: dict[int, TopicPartition] = {}
        self.workers: dict[int, ActorRef[WorkerMessage]] = {}
        self._worker_epoch: dict[int, int] = {}
        # Workers whose batch did not fit, with its size: take() wakes those whose batch
        # fits in the room it made (oldest first), instead of leaving them idle until
        # their next poll-fallback tick or waking every one to be refused again.
        self._refused: dict[int, tuple[ActorRef[WorkerMessage], int]] = {}
        # partition id -> the worker being revoked (on_revoke has run or is running):
        # nothing more of its batches is handed out.
        self._revoking: dict[int, ActorRef[WorkerMessage] | None] = {}
        # Partitions the user paused (Consumer.pause): their buffered batches wait aside in
        # `held` (not counted against the capacity) and their workers' further batches are
        # refused (the worker keeps one) until they are resumed.
        self.paused: set[TopicPartition] = set()
        self.held: dict[int, deque[tuple[Batch, int]]] = {}
        self._paused_workers: dict[int, ActorRef[WorkerMessage]] = {}
        # partition id -> the offset a seek moved it to, until something is polled from it.
        self.sought: dict[int, int] = {}

    # -- the workers' side ---------------------------------------------------------

    def acquired(self, partition_id: int, epoch: int, worker: ActorRef[WorkerMessage]) -> None:
        """Know the partition's worker from its lease on (a seek of an empty partition reaches it)."""
        self.workers[partition_id] = worker
        self._worker_epoch[partition_id] = epoch

    def offer(self, batch: Batch) -> bool:
        """Buffer a batch; False when it does not fit (the worker keeps it and tries again)."""
        if batch.partition_id in self._revoking:
            if self._revoking[batch.partition_id] is batch.worker:
                return False  # being revoked: the worker drops it when it stops
            del self._revoking[batch.partition_id]  # a new worker: the partition came back
        if self.paused and TopicPartition(batch.topic, batch.partition) in self.paused:
            self._paused_workers[batch.partition_id] = batch.worker
            self.tp_of[batch.partition_id] = TopicPartition(batch.topic, batch.partition)
            return False
        if self.buffered and self.buffered + len(batch.rows) > self.capacity:
            self._refused[batch.partition_id] = (batch.worker, len(batch.rows))
            return False
        self.buffer.append((batch, 0))
        self.buffered += len(batch.rows)
        self.tp_of[batch.partition_id] = TopicPartition(batch.topic, batch.partition)
        self.workers[batch.partition_id] = batch.worker
        self._worker_epoch[batch.partition_id] = batch.epoch
        self.ready.set()
        return True

    def consumed(self, partition_id: int, epoch: int) -> int | None:
        """With auto_commit, the position a stopping worker commits (None: commit nothing)."""
        # Inside an open transaction() the positions belong to the caller's
        # transaction: committing them outside it could lose what it rolls back.
        if not self.auto_commit or self.in_transaction:
            return None
        polled = self.polled.get(partition_id)
        if polled is None or polled[0] != epoch:
            return None
        return polled[1]

    def revoked(self, partition_id: int, epoch: int) -> None:
        """Drop whatever is buffered from this lease."""
        self.drop_buffered(partition_id, epoch)

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
        for pid in [pid for pid, tp in self.tp_of.items() if tp in tps]:
            self._revoking[pid] = self.workers.get(pid)
            self.drop_buffered(pid, None)
            self._paused_workers.pop(pid, None)
        self.paused -= tps  # a partition that comes back comes back unpaused
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
        polled = self.polled.get(partition_id)
        if polled is not None and polled[0] == epoch:
            settled = (
                committed == polled[1]
                or self.committed.get(partition_id) == polled
                or self.unconfirmed.get(partition_id) == polled
            )
            if not settled:
                self.moved[partition_id] = self.tp_of.get(
                    partition_id, TopicPartition("?", str(partition_id))
                )
            self.forget(partition_id)
        if self._worker_epoch.get(partition_id) == epoch:
            self.workers.pop(partition_id, None)
            self._worker_epoch.pop(partition_id, None)

    async def handle(self, topic: str, partition: str, row: asyncpg.Record, attempt: int) -> None:
        raise RuntimeError("a poll consumer has no handler")

    async def dead_letter(
        self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int
    ) -> bool:
        return False

    # -- the consumer's side -------------------------------------------------------

    def take(self, limit: int) -> list[Message]:
        """Up to `limit` buffered messages, in order per partition; records the polled positions."""
        out: list[Message] = []
        while self.buffer and len(out) < limit:
            batch, index = self.buffer.popleft()
            rows = batch.rows[index : index + (limit - len(out))]
            out.extend(messages_from_rows(batch.topic, batch.partition, rows))
            self.buffered -= len(rows)
            _metrics.consumed(self.group, batch.topic, len(rows))
            self.polled[batch.partition_id] = (batch.epoch, rows[-1]["offset"] + 1)
            self.sought.pop(batch.partition_id, None)
            if index + len(rows) < len(batch.rows):
                self.buffer.appendleft((batch, index + len(rows)))
        if out and self._refused:
            self._wake_refused()
        return out

    def _wake_refused(self) -> None:
        """Wake the refused workers whose batches now fit (an empty buffer takes any one batch)."""
        room = self.capacity - self.buffered
        for pid, (worker, size) in list(self._refused.items()):
            if size > room and room < self.capacity:  # does not fit, and the buffer is not empty
                continue
            del self._refused[pid]
            worker.signal(Wake())
            room -= size

    def drop_buffered(self, partition_id: int, epoch: int | None) -> None:
        """Drop buffered batches of a partition (of one lease epoch, or of any when None)."""
        kept: deque[tuple[Batch, int]] = deque()
        for batch, index in self.buffer:
            if batch.partition_id == partition_id and (epoch is None or batch.epoch == epoch):
                self.buffered -= len(batch.rows) - index
            else:
                kept.append((batch, index))
        self.buffer = kept
        held = self.held.get(partition_id)
        if held is not None:
            remaining = deque((b, i) for b, i in held if epoch is not None and b.epoch != epoch)
            if remaining:
                self.held[partition_id] = remaining
            else:
                del self.held[partition_id]

    def pause(self, tps: set[TopicPartition]) -> None:
        """Set these partitions' buffered batches aside and refuse their further batches."""
        self.paused |= tps
        kept: deque[tuple[Batch, int]] = deque()
        for batch, index in self.buffer:
            if TopicPartition(batch.topic, batch.partition) in self.paused:
                self.held.setdefault(batch.partition_id, deque()).append((batch, index))
                self.buffered -= len(batch.rows) - index
            else:
                kept.append((batch, index))
        self.buffer = kept

    def resume(self, tps: set[TopicPartition]) -> None:
        """Hand these partitions' batches out again and wake their workers."""
        self.paused -= tps
        for pid in [pid for pid in self.held if self.tp_of.get(pid) in tps]:
            for batch, index in self.held.pop(pid):
                self.buffer.append((batch, index))
                self.buffered += len(batch.rows) - index
        for pid in [pid for pid in self._paused_workers if self.tp_of.get(pid) in tps]:
            self._paused_workers.pop(pid).signal(Wake())
        if self.buffer:
            self.ready.set()

    def next_offset(self, partition_id: int) -> int | None:
        """The offset the next poll returns from this partition, when this consumer knows it."""
        for batch, index in (*self.held.get(partition_id, ()), *self.buffer):
            if batch.partition_id == partition_id:
                offset: int = batch.rows[index]["offset"]
                return offset
        polled = self.polled.get(partition_id)
        if polled is not None:
            return polled[1]
        return self.sought.get(partition_id)

    def pending(self) -> list[tuple[int, int, int]]:
        """(partition id, offset, epoch) of every polled position not known to be committed."""
        return [
            (pid, offset, epoch)
            for pid, (epoch, offset) in self.polled.items()
            if self.committed.get(pid) != (epoch, offset)
        ]

    def confirm(self, written: list[tuple[int, int, int]]) -> None:
        for pid, offset, epoch in written:
            self.committed[pid] = (epoch, offset)
            self.unconfirmed.pop(pid, None)

    def sent(self, written: list[tuple[int, int, int]]) -> None:
        self.unconfirmed.update({pid: (epoch, offset) for pid, offset, epoch in written})

    def forget(self, partition_id: int) -> None:
        for table in (self.polled, self.committed, self.unconfirmed, self.sought):
            table.pop(partition_id, None)

    def reset_positions(self) -> None:
        """Forget every position and drop the buffer (a rewind: the database's committed offsets rule)."""
        self.moved.clear()
        for table in (self.polled, self.committed, self.unconfirmed, self.sought):
            table.clear()
        self.buffer.clear()
        self.held.clear()
        self.buffered = 0


class HandlerHandoff(MemberState):
    """The subscription's side of the hand-off: the user's handler, retries and the dead-letter topic."""

    handler_mode = True

    def __init__(
        self,
        ctx: BusContext,
        group: str,
        handler: Callable[[Message], Awaitable[Any]],
        retry: RetryPolicy,
        dead_letter_topic: str | None,
        on_assign: Callback | None,
        on_revoke: Callback | None,
        transactional: bool = False,
    ) -> None:
        super().__init__(group, on_assign, on_revoke)
        self._ctx = ctx
        self.transactional = transactional
        self.handler = handler
        self.retry = retry
        self.dead_letter_topic = dead_letter_topic
        self.processed = 0
        self.dead_lettered = 0

    def acquired(self, partition_id: int, epoch: int, worker: ActorRef[WorkerMessage]) -> None:
        return None

    def offer(self, batch: Batch) -> bool:
        raise RuntimeError("a subscription handles messages itself")

    def consumed(self, partition_id: int, epoch: int) -> int | None:
        return None

    def revoked(self, partition_id: int, epoch: int) -> None:
        return None

    def released(self, partition_id: int, epoch: int, committed: int | None) -> None:
        return None

    async def handle(self, topic: str, partition: str, row: asyncpg.Record, attempt: int) -> None:
        (message,) = messages_from_rows(topic, partition, [row], attempt)
        if tracing.processing_wanted(message):
            with tracing.processing(message, self.group):
                await self.handler(message)
        else:
            await self.handler(message)
        self.processed += 1
        _metrics.consumed(self.group, topic)

    async def dead_letter(
        self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int
    ) -> bool:
        if self.dead_letter_topic is None:
            return False
        info = await dead_letter_topic(self._ctx, self.dead_letter_topic)
        (m,) = messages_from_rows(topic, partition, [row], attempts)
        out = dead_letter_outgoing(m, info, self.group, error, attempts)
        await self._ctx.publish_many(self.dead_letter_topic, [out])
        self.dead_lettered += 1
        return True

    async def handle_transaction(
        self, spec: WorkerSpec, epoch: int, rows: list[asyncpg.Record], now: datetime | None
    ) -> TxOutcome:
        """Run the handler on `rows` in one transaction, a savepoint each, and commit their offsets in it.

        The batch stops at a message that fails with attempts left (it comes again
        after the backoff) or on its last attempt without a dead-letter topic (the
        partition stops there). A fence that no longer holds rolls everything back.
        """
        ctx = self._ctx
        pid = spec.partition_id
        messages = messages_from_rows(spec.topic, spec.partition, rows)
        dlq: TopicInfo | None = None
        if self.dead_letter_topic is not None:
            dlq = await dead_letter_topic(ctx, self.dead_letter_topic)
        retries = Retries(ctx, self.group, self.retry, dlq, lambda _m: pid)
        handler = cast("Callable[[Message, Transaction], Awaitable[Any]]", self.handler)
        failed: int | None = None
        processed = 0
        try:
            with db.translate_errors():
                async with ctx.pool.acquire() as conn, conn.transaction():
                    await conn.execute(db.SET_LOCAL_SEARCH_PATH, USER_SEARCH_PATH)
                    tx = Transaction(conn, retries)
                    position = messages[0].offset
                    for index, m in enumerate(messages):
                        dead = tx.dead_lettered
                        try:
                            async with tx.message(m) as attempt:
                                m = msgspec.structs.replace(m, attempt=attempt)
                                if tracing.processing_wanted(m):
                                    with tracing.processing(m, self.group):
                                        await handler(m, tx)
                                else:
                                    await handler(m, tx)
                        except Exception:
                            if pid not in tx.stuck:
                                raise  # not the handler's error: the transaction is lost
                        if pid in tx.stuck:
                            failed = index
                            break
                        processed += tx.dead_lettered == dead
                        position = m.offset + 1
                    async with db.on_schema(conn, ctx.config.schema):
                        fence = [(pid, position, epoch)]
                        if pid not in await leases.commit(conn, self.group, spec.member_id, fence, now):
                            raise _Fenced
                        await tx.settle(pid, position)
        except _Fenced:
            return TxOutcome(None)
        self.processed += processed
        self.dead_lettered += tx.dead_lettered
        if processed:
            _metrics.consumed(self.group, spec.topic, processed)
        if failed is None:
            return TxOutcome(position)
        stuck = tx.stuck[pid]
        return TxOutcome(position, failed, stuck.attempts, stuck.error if stuck.stopped else None)


class _Fenced(Exception):
    """The partition's lease moved on before the transaction's commit: roll it back."""
