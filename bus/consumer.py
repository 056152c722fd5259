"""Consumer groups for users: the poll-style Consumer and the handler-style Subscription.

Both are thin: the actors (Coordinator, PartitionWorkers, Rebalancer,
HeartbeatMonitor) do the work and hand messages over through the objects in
`bus.handoff` (a bounded buffer for a Consumer, the handler for a
Subscription). A Consumer's `commit()` writes the positions the user has
polled through, fenced by each partition's lease epoch.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from actors.assignors import ASSIGNORS
from actors.coordinator import MemberSpec
from actors.messages import CoordinatorMessage, Rewind, Seek
from actors.runtime import ActorRef, ActorStoppedError
from actors.worker import RetryPolicy
from bus import tracing
from bus.context import context_of
from bus.handoff import Callback, HandlerHandoff, PollHandoff
from bus.start import StartInput, parse_start
from bus.transaction import USER_SEARCH_PATH, Retries, Transaction, dead_letter_topic
from bus.types import Message, TopicPartition
from storage import db, leases
from storage import groups as group_sql
from storage.errors import (
    BusError,
    StaleGenerationError,
    StorageUnavailableError,
    ValidationError,
)
from storage.logs import get_logger
from storage.names import validate_int, validate_name, validate_offset

if TYPE_CHECKING:
    from bus.context import BusContext, Connected

log = get_logger(__name__)


@dataclass(frozen=True)
class Retry:
    """Handler retries: `max_attempts` in all, waiting `backoff` seconds, doubling, up to `max_backoff`."""

    max_attempts: int = 3
    backoff: float = 0.5
    max_backoff: float = 30.0

    def policy(self) -> RetryPolicy:
        """The worker's policy; ValidationError if a field is out of range."""
        return RetryPolicy.checked(self.max_attempts, self.backoff, self.max_backoff)


def _validate_topics(topics: object, namespace: str | None, task: str | None) -> tuple[str, ...]:
    if topics is None:
        if namespace is None and task is None:
            raise ValidationError(
                "name the topics to read (topics=[...]) or a label (namespace=... / task=...)"
            )
        return ()
    if not isinstance(topics, (list, tuple)) or not all(
        isinstance(t, str) for t in cast("list[object]", topics)
    ):
        raise ValidationError("topics must be a list of topic names")
    if not topics:
        raise ValidationError("topics is empty: name at least one topic")
    return tuple(validate_name(t, "topic name") for t in topics)


@dataclass
class _Member:
    """The group settings a Consumer or Subscription joins with."""

    group: str
    topics: tuple[str, ...]
    namespace: str | None
    task: str | None
    start: StartInput
    assignor: str
    instance_id: str | None
    fetch_size: int


async def _join_group(ctx: BusContext, m: _Member) -> None:
    """Record the group (its start: first subscriber wins) and the topics it reads."""
    spec = parse_start(m.start, ctx.config.default_start)
    for t in m.topics:
        await ctx.topic(t)  # TopicNotFoundError before anything is written
    with db.translate_errors():
        async with ctx.pool.acquire() as conn, conn.transaction():
            await group_sql.record_group(
                conn,
                group_sql.RecordGroupParams(
                    name=m.group,
                    start_mode=spec.start_mode,
                    start_time=spec.start_time,
                    start_offsets_json=spec.start_offsets_json,
                    lookback_seconds=ctx.config.lookback,
                    assignor=m.assignor,
                    namespace=m.namespace,
                    task=m.task,
                ),
            )
            if m.topics:
                await group_sql.add_group_topics(conn, m.group, list(m.topics))
            else:
                await group_sql.add_matching_topics(conn, m.group)


def _member_spec(ctx: BusContext, m: _Member) -> MemberSpec:
    c = ctx.config
    return MemberSpec(
        group=m.group,
        topics=m.topics,
        instance_id=m.instance_id,
        client_id=f"{os.getpid()}-{id(ctx):x}",
        session_timeout=c.session_timeout,
        rebalance_delay=c.rebalance_delay,
        lease_time=c.lease_time,
        poll_interval=c.fallback_poll,
        fetch_size=m.fetch_size,
        groups_channel=ctx.channels.groups,
        messages_channel=ctx.channels.messages,
        now=lambda: ctx.now(),  # read at each statement: a Clock made later still moves it
    )


#: The open transaction of `Consumer.transaction()` (the name it had before `bus.Transaction`).
ConsumerTransaction = Transaction


class _MemberBase:
    """What Consumer and Subscription share: joining, the Coordinator, what its actors told it."""

    def __init__(self, ctx: BusContext, member: _Member, state: PollHandoff | HandlerHandoff) -> None:
        self._ctx = ctx
        self._m = member
        self._state = state
        self._coordinator: ActorRef[CoordinatorMessage] | None = None

    @staticmethod
    def _validate(member: _Member) -> None:
        validate_name(member.group, "group name")
        if member.assignor not in ASSIGNORS:
            raise ValidationError(f"assignor must be one of {ASSIGNORS}, not {member.assignor!r}")
        if member.instance_id is not None:
            validate_name(member.instance_id, "instance_id")

    @property
    def group(self) -> str:
        """The group this member belongs to."""
        return self._m.group

    @property
    def member_id(self) -> str | None:
        """This member's id in the group: known once `start()` (or `async with`) returned.

        None only if the database could not be reached while starting (the member
        joins as soon as it can; the id is known from then on).
        """
        return self._state.member_id

    @property
    def generation(self) -> int:
        """The group generation this member last saw (-1 before it joined)."""
        return self._state.generation

    @property
    def errors(self) -> list[str]:
        """Errors the member's actors reported (a failed handler, a rebalance callback that raised)."""
        return self._state.errors

    @property
    def has_error(self) -> asyncio.Event:
        """Set once anything is in `errors`."""
        return self._state.has_error

    async def _start_member(self) -> None:
        if self._coordinator is not None:
            return
        await _join_group(self._ctx, self._m)
        system = await self._ctx.group_system()
        self._coordinator = system.spawn_member(_member_spec(self._ctx, self._m), self._state)
        # Returns joined: the member's id is known (its partitions come with the group's next
        # generation, see wait_assigned). An unreachable database does not hold start() forever.
        try:
            await asyncio.wait_for(self._state.joined.wait(), self._ctx.config.session_timeout)
        except TimeoutError:
            log.warning("join_not_confirmed", group=self.group)

    async def _stop_member(self) -> None:
        if self._coordinator is not None:
            ref, self._coordinator = self._coordinator, None
            await ref.stop(drain=False)

    def assignment(self) -> set[TopicPartition]:
        """The partitions this member owns now (sync)."""
        return set(self._state.assignment)

    async def wait_assigned(self, timeout: float = 30.0) -> set[TopicPartition]:  # noqa: ASYNC109
        """Wait until this member has been given at least one partition (useful in tests and startup)."""
        await asyncio.wait_for(self._state.assigned.wait(), timeout)
        return self.assignment()


class Consumer(_MemberBase):
    """A poll-style group member (aiokafka's shape): `async with`, `poll`, `async for`, `commit`."""

    def __init__(
        self,
        ctx: BusContext | Connected,
        group: str,
        *,
        topics: list[str] | None = None,
        namespace: str | None = None,
        task: str | None = None,
        start: StartInput = None,
        auto_commit: bool = True,
        max_poll_records: int = 500,
        assignor: str = "range",
        instance_id: str | None = None,
        on_assign: Callback | None = None,
        on_revoke: Callback | None = None,
        buffer_size: int | None = None,
    ) -> None:
        ctx = context_of(ctx)
        validate_int(max_poll_records, "max_poll_records", 1, 100_000)
        topic_list = _validate_topics(topics, namespace, task)
        if namespace is not None:
            validate_name(namespace, "namespace")
        if task is not None:
            validate_name(task, "task")
        parse_start(start, ctx.config.default_start)  # validate before anything is written
        member = _Member(
            group, topic_list, namespace, task, start, assignor, instance_id, min(max_poll_records, 1000)
        )
        self._validate(member)
        # Room for a few fetches of several partitions at once, so fetching overlaps the user's work.
        self._h = PollHandoff(
            group,
            on_assign,
            on_revoke,
            capacity=buffer_size or max(4 * max_poll_records, 2000),
            auto_commit=auto_commit,
        )
        super().__init__(ctx, member, self._h)
        self.auto_commit = auto_commit
        self.max_poll_records = max_poll_records
        # A failed transaction() left positions past the committed offsets: poll() rewinds first.
        self._must_rewind = False
        self._closed = False

    @property
    def buffered(self) -> int:
        """Messages fetched for this consumer and not polled yet: at most `buffer_size` plus one fetch."""
        return self._h.buffered

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> Consumer:
        """Join the group (records its start if the group is new)."""
        await self._start_member()
        return self

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None:
            # The block failed while handling what it polled last: with auto_commit, leaving
            # must not commit that batch (it comes again), only what earlier polls committed.
            self._h.auto_commit = False
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
            async with self._ctx.pool.acquire() as conn:
                await group_sql.cancel_group(conn, self.group)

    # -- consuming -----------------------------------------------------------------

    async def poll(self, timeout: float = 1.0, max_records: int | None = None) -> list[Message]:  # noqa: ASYNC109
        """Up to `max_records` (default max_poll_records) messages, waiting at most `timeout` seconds.

        With auto_commit, the positions of the previous poll are committed first.
        """
        if self._coordinator is None:
            raise BusError("the consumer is not started: use `async with b.consumer(...) as c:`")
        if self._must_rewind:
            await self.rewind()
        h = self._h
        if self.auto_commit and not h.in_transaction:
            try:
                await self._commit_pool(durable=False)
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
        while not h.buffer:
            h.ready.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(h.ready.wait(), remaining)
            except TimeoutError:
                return []
        messages = h.take(limit)
        tracing.received("poll", messages, group=self.group)
        return messages

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while not self._closed:
            for m in await self.poll(timeout=self._ctx.config.max_poll_interval):
                yield m

    # -- committing ------------------------------------------------------------------

    async def commit(self, connection: db.Connection | None = None) -> None:
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
                async with db.on_schema(connection, self._ctx.config.schema), connection.transaction():
                    written = await self._commit_on(connection)
            # The caller may still roll back: remembered as sent, not as committed.
            # A later commit re-sends it harmlessly, and never takes it for a move.
            self._h.sent(written)
            return
        await self._commit_pool(durable=True)

    async def _commit_pool(self, *, durable: bool) -> None:
        """Commit the pending positions on a pool connection; `durable=False` for auto-commit (soft)."""
        # One statement, all or nothing: no transaction block needed.
        with db.translate_errors():
            async with self._ctx.lender.lend() as conn:
                written = await self._commit_on(conn, durable=durable)
        self._h.confirm(written)

    def _raise_moved(self, moved: list[str]) -> None:
        raise StaleGenerationError(
            f"group {self.group!r} moved on: partition(s) {', '.join(sorted(moved))} are no longer owned by "
            f"member {self.member_id} (rebalanced or lease lost); nothing was committed, their new "
            "owner will read those messages again; call `await c.rewind()` (transaction() does) and poll again"
        )

    async def _commit_on(self, conn: db.Connection, *, durable: bool = True) -> list[tuple[int, int, int]]:
        """Write the pending positions on `conn`, all or nothing; what was written. Raises on a move."""
        h = self._h
        if h.moved:
            moved, h.moved = h.moved, {}
            self._raise_moved([str(tp) for tp in moved.values()])
        pending = h.pending()
        if self.member_id is None:
            return []
        while pending:
            applied, gone = await leases.commit_all(
                conn, self.group, self.member_id, pending, durable=durable, now=self._ctx.now()
            )
            if applied:
                return pending
            # A position sent earlier inside a caller's transaction that did commit
            # is not a move: the partition left since, its offset is already there.
            entry = {pid: (epoch, offset) for pid, offset, epoch in pending}
            resent = {
                pid
                for pid, stored in gone.items()
                if h.unconfirmed.get(pid) == entry[pid] and stored >= entry[pid][1]
            }
            for pid in resent:
                h.forget(pid)
            lost = set(gone) - resent
            if lost:
                # Report a move once; its new owner re-reads those messages. Nothing applied.
                for pid in lost:
                    h.forget(pid)
                self._raise_moved([str(h.tp_of.get(p, p)) for p in lost])
            pending = [e for e in pending if e[0] not in resent]
        return []

    def commit_async(self) -> asyncio.Task[None]:
        """Commit in the background; the task raises what `commit()` would."""
        return asyncio.get_running_loop().create_task(self.commit())

    @asynccontextmanager
    async def transaction(
        self, *, retry: Retry | None = None, dead_letter: str | None = None
    ) -> AsyncIterator[Transaction]:
        """Effectively-once: the caller's writes and the offsets of what it polls inside commit together.

        `tx.connection` is a pool connection in an open transaction, with
        PostgreSQL's default search_path (your tables, not the bus's). Leaving
        the block without an error commits the writes and the fenced offsets
        in that one transaction. On any error (StaleGenerationError from the
        offsets, or your own) everything rolls back and every partition this
        member still owns is rewound to its committed offset, so the batch
        comes again; partitions that moved go to their new owner from the
        committed offset. Nothing is lost, nothing applies twice.

        With `retry` (and `dead_letter`), wrap each message's work in
        `async with tx.message(m):` — a savepoint of its own: a message that
        fails rolls back alone and is counted (in the database, with the
        offsets), the messages before it commit, and its partition comes again
        from it after the backoff; after `retry.max_attempts` it is published to
        `dead_letter` (with its error history in the headers) in this same
        transaction. Without `dead_letter` the last attempt's error propagates.
        """
        if self._coordinator is None:
            raise BusError("the consumer is not started: use `async with b.consumer(...) as c:`")
        h = self._h
        if h.in_transaction:
            raise BusError("a transaction is already open on this consumer: finish it before opening another")
        if dead_letter is not None:
            validate_name(dead_letter, "dead_letter topic")
            if retry is None:
                retry = Retry()
        retries: Retries | None = None
        if retry is not None:
            dlq = None if dead_letter is None else await dead_letter_topic(self._ctx, dead_letter)
            retries = Retries(self._ctx, self.group, retry.policy(), dlq, self._partition_id_of)
        if self._must_rewind:
            await self.rewind()
        with db.translate_errors():
            async with self._ctx.pool.acquire() as conn:
                tx = conn.transaction()
                h.in_transaction = True
                try:
                    await tx.start()
                    await conn.execute(db.SET_LOCAL_SEARCH_PATH, USER_SEARCH_PATH)
                    work = Transaction(conn, retries)
                    yield work
                    stuck = self._stop_at_failures(work)
                    async with db.on_schema(conn, self._ctx.config.schema):
                        written = await self._commit_on(conn)
                        for pid, offset, _epoch in written:
                            await work.settle(pid, offset)
                    await tx.commit()
                except BaseException:
                    h.in_transaction = False
                    self._must_rewind = True
                    try:
                        await tx.rollback()
                    except Exception:  # the connection is gone: the server rolled back
                        pass
                    try:
                        await self.rewind()
                    except Exception as exc:
                        # poll() rewinds first while _must_rewind stays set.
                        log.warning("rewind_failed", group=self.group, member=self.member_id, error=repr(exc))
                    raise
                h.in_transaction = False
                h.confirm(written)
        if stuck:
            await self._retry_later(stuck, retry)

    def _partition_id_of(self, m: Message) -> int:
        for pid, tp in self._h.tp_of.items():
            if tp.topic == m.topic and tp.partition == m.partition:
                return pid
        raise ValidationError(f"{m.topic}/{m.partition} was not polled by this consumer")

    def _stop_at_failures(self, work: Transaction) -> dict[TopicPartition, int]:
        """Commit each partition with a failed message up to that message, not past it."""
        stuck: dict[TopicPartition, int] = {}
        for pid, failure in work.stuck.items():
            polled = self._h.polled.get(pid)
            if polled is not None:
                self._h.polled[pid] = (polled[0], failure.offset)
            stuck[self._h.tp_of[pid]] = failure.attempts
        return stuck

    async def _retry_later(self, stuck: dict[TopicPartition, int], retry: Retry | None) -> None:
        """The partitions with a failed message come again from it after the retry's backoff."""
        policy = (retry or Retry()).policy()
        await self.rewind()
        loop = asyncio.get_running_loop()
        for tp, attempts in stuck.items():
            if tp in self._h.assignment and tp not in self._h.paused:
                self._h.pause({tp})
                loop.call_later(policy.delay(attempts), self._resume_after_backoff, tp)

    def _resume_after_backoff(self, tp: TopicPartition) -> None:
        if tp in self._h.paused and not self._closed:
            self._h.resume({tp})

    async def rewind(self) -> None:
        """Sync positions back to the committed offsets of every owned partition.

        Everything polled and not committed comes again (buffered messages are
        dropped); partitions that moved are forgotten (their new owner reads
        from the committed offset). Call it after a `commit(connection=...)`
        raised or its transaction rolled back.
        """
        self._must_rewind = True
        h = self._h
        h.reset_positions()
        for pid, worker in list(h.workers.items()):
            try:
                done = await worker.ask(Rewind(), timeout=30.0)
            except ActorStoppedError:
                continue  # the partition left: its next owner starts from the committed offset
            if not done:
                raise StorageUnavailableError(
                    f"could not read the committed offset of {h.tp_of.get(pid, pid)}; "
                    "PostgreSQL is unavailable: retry (poll() rewinds first)"
                )
        self._must_rewind = False

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """Continue partition `tp` from `offset` (it must be assigned to this consumer)."""
        validate_offset(offset)
        h = self._h
        if tp not in h.assignment:
            raise ValidationError(
                f"{tp} is not assigned to this consumer (assignment: {sorted(h.assignment)})"
            )
        pid = next((p for p, t in h.tp_of.items() if t == tp), None)
        if pid is None:  # nothing polled from it yet: its id from the database
            (row,) = await self._offsets([tp])
            pid = row.partition_id
            h.tp_of[pid] = tp
        worker = h.workers.get(pid)
        if worker is None:
            raise BusError(f"{tp} has no running worker yet; retry after the first poll")
        assert pid is not None
        h.drop_buffered(pid, None)
        h.polled.pop(pid, None)
        await worker.ask(Seek(offset), timeout=30.0)  # answered once nothing older can be polled
        h.sought[pid] = offset

    async def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        """Continue each partition (default: every assigned one) from the first offset still kept."""
        for row in await self._offsets(self._assigned(partitions, default_all=True)):
            await self.seek(TopicPartition(row.topic, row.partition), row.log_start)

    async def seek_to_end(self, *partitions: TopicPartition) -> None:
        """Continue each partition (default: every assigned one) after its last message (new ones only)."""
        for row in await self._offsets(self._assigned(partitions, default_all=True)):
            await self.seek(TopicPartition(row.topic, row.partition), row.next_offset)

    # -- flow control and offsets (aiokafka's names) ---------------------------------------

    def pause(self, *partitions: TopicPartition) -> None:
        """Stop returning messages of these assigned partitions from poll; they stay assigned (sync)."""
        self._h.pause(self._assigned(partitions))

    def resume(self, *partitions: TopicPartition) -> None:
        """Return messages of these paused partitions from poll again, from where they stopped (sync)."""
        self._h.resume(self._assigned(partitions))

    def paused(self) -> set[TopicPartition]:
        """The partitions paused now (a partition revoked and assigned again comes back unpaused)."""
        return set(self._h.paused)

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next message poll returns from assigned partition `tp`."""
        self._assigned((tp,))
        (row,) = await self._offsets([tp])
        known = self._h.next_offset(row.partition_id)
        if known is not None:
            return known
        return max(row.committed if row.committed is not None else row.log_start, row.log_start)

    async def committed(self, tp: TopicPartition) -> int | None:
        """The group's committed offset on `tp` (None: the group has no cursor there yet)."""
        (row,) = await self._offsets([tp])
        return row.committed

    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The first offset still kept of each partition (retention and compaction move it)."""
        return {TopicPartition(r.topic, r.partition): r.log_start for r in await self._offsets(partitions)}

    async def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The offset the next message published to each partition gets (its last offset + 1)."""
        return {TopicPartition(r.topic, r.partition): r.next_offset for r in await self._offsets(partitions)}

    async def offsets_for_times(
        self, times: Mapping[TopicPartition, datetime]
    ) -> dict[TopicPartition, int | None]:
        """The first offset of each partition created at or after its time (None: none is)."""
        for when in times.values():
            if not isinstance(when, datetime) or when.tzinfo is None:
                raise ValidationError(f"offsets_for_times wants timezone-aware datetimes, got {when!r}")
        rows = await self._offsets(times.keys(), list(times.values()))
        return {TopicPartition(r.topic, r.partition): r.at_offset for r in rows}

    def _assigned(
        self, partitions: Iterable[TopicPartition], *, default_all: bool = False
    ) -> set[TopicPartition]:
        tps = set(partitions)
        if not tps and default_all:
            return set(self._h.assignment)
        for tp in tps:
            if not isinstance(tp, TopicPartition):
                raise ValidationError(f"expected bus.TopicPartition, got {tp!r}")
        missing = tps - self._h.assignment
        if missing:
            raise ValidationError(
                f"{sorted(missing)} not assigned to this consumer (assignment: {sorted(self._h.assignment)})"
            )
        return tps

    async def _offsets(
        self, partitions: Iterable[TopicPartition], times: list[datetime] | None = None
    ) -> list[group_sql.PartitionOffsetsRow]:
        tps = list(partitions)
        for tp in tps:
            if not isinstance(tp, TopicPartition):
                raise ValidationError(f"expected bus.TopicPartition, got {tp!r}")
        rows = await group_sql.partition_offsets(
            self._ctx.pool,
            self.group,
            [(tp.topic, tp.partition) for tp in tps],
            list(times) if times else None,
        )
        if len(rows) != len(tps):
            found = {TopicPartition(r.topic, r.partition) for r in rows}
            raise ValidationError(f"no such partition: {sorted(set(tps) - found)}")
        return rows


class Subscription(_MemberBase):
    """A handler-style group member: the actors call `handler(message)` per message,
    partitions concurrently, in order within each.

    `transactional=True`: the actors call `handler(message, tx)` (`tx: bus.Transaction`)
    and everything the handler writes on `tx.connection`, what it publishes there,
    and the commit of the message's offset are one transaction (the messages of a
    fetch share it, each under its own savepoint). A failing message rolls back
    alone; its attempts are counted in the database (a retry survives a crash);
    after `retry.max_attempts` its dead-letter publish and the commit past it are
    one transaction.
    """

    def __init__(
        self,
        ctx: BusContext | Connected,
        group: str,
        handler: Callable[[Message], Awaitable[Any]],
        *,
        topics: list[str] | None = None,
        namespace: str | None = None,
        task: str | None = None,
        start: StartInput = None,
        retry: Retry | None = None,
        dead_letter: str | None = None,
        assignor: str = "range",
        instance_id: str | None = None,
        batch_size: int = 100,
        on_assign: Callback | None = None,
        on_revoke: Callback | None = None,
        transactional: bool = False,
    ) -> None:
        ctx = context_of(ctx)
        if not callable(handler):
            raise ValidationError(
                "handler must be an async callable taking a bus.Message"
                + (" and a bus.Transaction" if transactional else "")
            )
        if not isinstance(transactional, bool):
            raise ValidationError(f"transactional must be True or False, not {transactional!r}")
        topic_list = _validate_topics(topics, namespace, task)
        if dead_letter is not None:
            validate_name(dead_letter, "dead_letter topic")
        parse_start(start, ctx.config.default_start)
        member = _Member(group, topic_list, namespace, task, start, assignor, instance_id, batch_size)
        self._validate(member)
        self._h = HandlerHandoff(
            ctx, group, handler, (retry or Retry()).policy(), dead_letter, on_assign, on_revoke, transactional
        )
        super().__init__(ctx, member, self._h)

    @property
    def handler(self) -> Callable[[Message], Awaitable[Any]]:
        """The user's handler."""
        return self._h.handler

    @property
    def processed(self) -> int:
        """Messages the handler finished without raising."""
        return self._h.processed

    @property
    def dead_lettered(self) -> int:
        """Messages sent to the dead-letter topic after their last attempt."""
        return self._h.dead_lettered

    async def start(self) -> Subscription:
        """Join the group and start handling (done by `b.subscribe`)."""
        await self._start_member()
        return self

    async def stop(self) -> None:
        """Stop handling: commit, release, leave the group."""
        await self._stop_member()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
