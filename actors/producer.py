"""The Producer: one per Bus; every publish from the Bus's own pool goes through it.

Kafka's producer answer to "one fsync per message however many callers"
is batching, and so is this one's. Callers validate and encode their
messages themselves (a message that fails validation fails alone and never
reaches the Producer), then hand the call over as a :class:`Publish` and
wait on its reply future. The Producer keeps the calls in arrival order and
writes them in flushes, up to `max_in_flight` (4) at once but never two that
share a partition, so each partition still commits in call order:

* nothing in flight: the calls that arrived together (until the mailbox is
  empty again) start a flush at once, in the Producer's own turn (no added
  latency; with `linger` > 0 the flusher first waits that long for companions);
* a flush in flight: arriving calls gather and go together in the next one,
  at most `max_batch` messages and `max_batch_bytes` payload bytes (a single
  call larger than that goes alone: `publish_many` stays atomic);
* each flush is one statement (`storage.messages.append`; a transaction
  around it only when idempotency keys are claimed), so per-partition order
  follows call order and offsets stay dense and commit in order (invariant 1);
* each caller gets its own places, or its own exception: when a flush fails
  for any reason but a lost connection, its calls are written again one by
  one, so one bad call cannot fail its companions;
* one wake-up per partition per flush: sent by the flush's own commit when
  it runs alone, else after commit through the Announcer (notifying commits
  serialize, so flushes side by side must not notify);
* back-pressure: `receive` stops taking calls while `max_pending` messages
  wait, so the bounded mailbox fills and callers wait in `tell`; memory stays
  flat under a flood of callers.

Outbox publishes (`connection=`) never come here: they are written in the
caller's transaction.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import asyncpg

from actors.runtime import Actor, ActorStoppedError, Message, start_eagerly
from storage import messages as log_sql
from storage.db import CONNECTION_ERRORS
from storage.errors import StorageUnavailableError
from storage.logs import get_logger

# A flush whose connection was lost (or could not be opened): its outcome is unknown.
_LOST: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, StorageUnavailableError)

__all__ = ["Producer", "ProducerSettings", "ProducerStats", "Publish", "Vanished"]


class Vanished(Exception):
    """A message's partition no longer exists (its topic was deleted while publishing)."""


class Publish(Message, frozen=True):
    """Append one call's messages; `reply` (an asyncio Future) gets their places, in input order, or the error.

    In-process only: `call` is a `storage.messages.Batch` (validated, encoded, partitions resolved)
    and `reply` a Future, never encoded.
    """

    call: Any
    reply: Any


class ProducerSettings(Message, frozen=True):
    """How the Producer batches (from the Bus's config)."""

    max_batch: int = 1000
    max_batch_bytes: int = 8 * 1024 * 1024
    linger: float = 0.0
    max_pending: int = 10_000
    max_in_flight: int = 4


class ProducerStats:
    """Counters shared with the Bus (they survive restarts of the actor): what waits, what was written."""

    def __init__(self) -> None:
        self.pending_calls = 0
        self.pending_messages = 0
        self.peak_pending_messages = 0
        self.flushes = 0
        self.flushed_messages = 0
        self.largest_flush = 0
        self.server_pids: set[int] = set()  # backends of the Producer's connections (for operators and tests)


class Producer(Actor[Publish]):
    """Coalesces concurrent pool publishes into one statement (and one transaction) per flush."""

    # Calls waiting in the mailbox while `max_pending` messages are pending: the back-pressure bound.
    mailbox_size = 1000

    def __init__(
        self,
        connect: Callable[[], Awaitable[asyncpg.Connection]],
        announce: Callable[[int], None],
        settings: ProducerSettings,
        stats: ProducerStats | None = None,
        channel: str | None = None,
        now: Callable[[], datetime | None] = lambda: None,
        planned: bool = False,
    ) -> None:
        # Connections of its own, not the pool's: a pool connection costs a reset round trip on
        # every release, which would be one more round trip per flush.
        self._connect = connect
        self._conns: list[asyncpg.Connection] = []  # idle ones
        self._open: set[asyncpg.Connection] = set()
        self._announce = announce
        self._channel = channel
        self._settings = settings
        self._now = now  # when idempotency windows are judged (None from it: the server's clock)
        # Its connections have storage.messages.PLANNED_SETTINGS: flushes without idempotency keys
        # move the heads in their own statement.
        self._planned = planned
        self.stats = stats if stats is not None else ProducerStats()
        self._pending: deque[Publish] = deque()
        self._pending_messages = 0
        self._busy: set[int] = set()  # partitions of the flushes in flight
        self._in_flight = 0  # flushes started and not ended
        self._flushes: set[asyncio.Future[None]] = set()  # their tasks (to cancel them)
        self._dispatching = False
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._flusher: asyncio.Task[None] | None = None
        # Without linger, flushes start right where a call arrives or a flush ends (no hop through
        # the flusher task); with linger, the flusher waits for companions first.
        self._direct = settings.linger <= 0
        self._failing = False
        self._log = get_logger(__name__, actor="producer")

    async def on_start(self) -> None:
        """Start the flusher task (with linger; without, flushes start where calls arrive and flushes end)."""
        if not self._direct:
            self._flusher = asyncio.get_running_loop().create_task(self._run(), name="producer-flusher")

    async def receive(self, message: Publish) -> None:
        """Queue the call for the next flush; wait while too many messages are pending (back-pressure)."""
        match message:
            case Publish(call=call, reply=reply):
                if not reply.done():  # else the caller gave up (cancelled) before its turn
                    self._pending.append(message)
                    self._pending_messages += len(call.pids)
                    self._count()
                    self._idle.clear()
                if not self._direct:
                    self._wake.set()
                elif not self.self_ref.queued:
                    # The burst this call came in is all here: write it now, in the free flush slots
                    # (on partitions no flush in flight holds; the rest goes when one ends).
                    self._dispatch()
                while self._pending_messages >= self._settings.max_pending:
                    if self._direct:
                        self._dispatch()  # room comes from flushes: start what the free slots allow
                    self._room.clear()
                    await self._room.wait()

    async def on_stop(self) -> None:
        """Write whatever is pending, then stop the flusher and close the connections."""
        await self._idle.wait()
        self._cancel_flusher()
        for conn in list(self._open):
            if not conn.is_closed():
                await conn.close()

    async def on_failure(self, exc: BaseException) -> None:
        """Nothing may hang: fail every pending call."""
        self._failing = True
        self._cancel_flusher()
        self._fail(list(self._pending), exc)
        self._pending.clear()
        for conn in list(self._open):
            self._drop(conn)

    def _drop(self, conn: asyncpg.Connection) -> None:
        conn.terminate()
        self._open.discard(conn)
        if conn in self._conns:
            self._conns.remove(conn)

    async def _acquire(self) -> asyncpg.Connection:
        while self._conns:
            conn = self._conns.pop()
            if not conn.is_closed():
                return conn
            self._open.discard(conn)
        conn = await self._connect()
        self._open.add(conn)
        self.stats.server_pids.add(conn.get_server_pid())
        return conn

    def _release(self, conn: asyncpg.Connection) -> None:
        if conn.is_closed() or conn.is_in_transaction():
            self._drop(conn)
        else:
            self._conns.append(conn)

    def _cancel_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        for task in list(self._flushes):
            task.cancel()

    def _count(self) -> None:
        stats = self.stats
        stats.pending_calls = len(self._pending)
        stats.pending_messages = self._pending_messages
        stats.peak_pending_messages = max(stats.peak_pending_messages, self._pending_messages)

    def _take(self) -> tuple[list[Publish], set[int]]:
        """The next batch and its partitions, within max_batch messages and bytes (at least one call).

        Calls go in arrival order, except that a call touching a partition of a flush still in
        flight waits (and so does every later call touching its partitions): flushes that run side
        by side never share a partition, so each partition's messages commit in call order.
        """
        settings = self._settings
        batch: list[Publish] = []
        parts: set[int] = set()
        blocked = set(self._busy)
        kept: deque[Publish] = deque()
        messages = nbytes = 0
        while self._pending:
            m = self._pending.popleft()
            call: log_sql.Batch = m.call
            n = len(call.pids)
            if batch and (
                messages + n > settings.max_batch or nbytes + call.nbytes > settings.max_batch_bytes
            ):
                self._pending.appendleft(m)
                break
            if n == 1:  # a single publish: no set to build
                pid = call.pids[0]
                if pid in blocked:
                    kept.append(m)
                    continue
                parts.add(pid)
            else:
                mine = set(call.pids)
                if not blocked.isdisjoint(mine):
                    blocked |= mine
                    kept.append(m)
                    continue
                parts |= mine
            batch.append(m)
            messages += n
            nbytes += call.nbytes
        kept.extend(self._pending)
        self._pending = kept
        self._pending_messages -= messages
        self._count()
        self._room.set()
        return batch, parts

    async def _run(self) -> None:
        linger = self._settings.linger
        while True:
            await self._wake.wait()
            self._wake.clear()
            if linger > 0 and self._pending_messages < self._settings.max_batch:
                await asyncio.sleep(linger)
            self._dispatch()

    def _dispatch(self) -> None:
        """Start flushes of what is pending, while flush slots are free (none once failing).

        A flush starts eagerly: its statement is sent in this turn, not on the loop's next one.
        A flush that ends before its first wait (its callers all gave up) frees its slot
        from inside this loop, which then goes on with it (no nested dispatch).
        """
        if self._failing or self._dispatching:
            return
        self._dispatching = True
        try:
            while self._in_flight < self._settings.max_in_flight:
                batch, parts = self._take()
                if not batch:
                    break
                self._busy |= parts
                self._in_flight += 1
                flush = self._flush_batch(batch, parts)
                # Eagerly only with a connection at hand: opening one may start a timeout, which
                # must belong to the flush's own task (see start_eagerly).
                if self._conns and not self._conns[-1].is_closed():
                    task = start_eagerly(flush, name="producer-flush")
                else:
                    task = asyncio.get_running_loop().create_task(flush, name="producer-flush")
                # (a flush that ended before its first wait freed its slot already)
                if not task.done():
                    self._flushes.add(task)
                    task.add_done_callback(self._flushes.discard)
        finally:
            self._dispatching = False
        if not self._pending and not self._in_flight:
            self._idle.set()

    async def _flush_batch(self, batch: list[Publish], parts: set[int]) -> None:
        try:
            conn = await self._acquire()
        except BaseException as exc:
            self._fail(batch, _unavailable(exc) if isinstance(exc, Exception) else exc)
            self._done(parts)
            if not isinstance(exc, Exception):
                raise
            return
        try:
            await self._flush(batch, conn)
        except asyncio.CancelledError:
            self._fail(batch, ActorStoppedError("the Producer stopped while writing; the outcome is unknown"))
            self._drop(conn)
            raise
        except Exception as exc:  # a bug: never leave a caller hanging
            self._log.exception("producer_flush_failed")
            self._fail(batch, exc)
            self._drop(conn)
        else:
            self._release(conn)
        finally:
            self._done(parts)

    def _done(self, parts: set[int]) -> None:
        self._in_flight -= 1
        self._busy -= parts
        if self._direct:
            self._dispatch()  # the next flush goes now (its partitions are free)
        else:
            self._wake.set()
        if not self._pending and not self._in_flight:
            self._idle.set()

    async def _flush(self, batch: list[Publish], conn: asyncpg.Connection) -> None:
        calls = [m for m in batch if not m.reply.done()]
        if not calls:
            return
        # One batch, one statement: a lone call's batch as it is, else the calls' joined.
        merged: log_sql.Batch = (
            calls[0].call if len(calls) == 1 else log_sql.Batch.joined([m.call for m in calls])
        )
        # A flush that runs alone sends its wake-ups with its commit (one statement, and the
        # listeners hear of it one round trip sooner); flushes side by side leave them to the
        # Announcer, because notifying commits serialize (see actors/announcer.py).
        notify = self._channel if self._in_flight <= 1 else None
        try:
            if merged.ikeys is not None:  # idempotency keys are claimed in the flush's transaction
                async with conn.transaction():
                    placed = await merged.append(conn, notify, self._now())
            else:
                placed = await merged.append(conn, notify, planned=self._planned)
        except _LOST as exc:
            # Nothing to isolate: every call's outcome is equally unknown; each caller retries (with its key).
            self._fail(calls, _unavailable(exc))
            return
        except Exception as exc:
            if len(calls) == 1:
                self._fail(calls, exc)
                return
            # One call's error must stay its own: write them one by one.
            self._log.info("producer_batch_failed_isolating", calls=len(calls), error=repr(exc))
            for m in calls:
                await self._flush([m], conn)
            return
        self.stats.flushes += 1
        self.stats.flushed_messages += len(merged.pids)
        self.stats.largest_flush = max(self.stats.largest_flush, len(merged.pids))
        start = 0
        for m in calls:
            end = start + len(m.call.pids)
            if not m.reply.done():
                m.reply.set_result(placed[start:end])
            start = end
        if notify is None:
            for pid in set(merged.pids):
                self._announce(pid)

    def _fail(self, calls: list[Publish], exc: BaseException) -> None:
        for m in calls:
            if not m.reply.done():
                m.reply.set_exception(exc)


def _unavailable(exc: BaseException) -> StorageUnavailableError:
    error = StorageUnavailableError(
        f"PostgreSQL is unavailable ({type(exc).__name__}: {exc}); the publish may or may not have been "
        "written: retry it (with an idempotency_key, a retry never writes a second copy)"
    )
    error.__cause__ = exc
    return error
