"""The PartitionWorker: one per owned partition.

It takes the partition's lease (fencing epoch), fetches batches when woken
(NOTIFY, the Bus's poll fallback, or "there is more"),
hands them on with backpressure, commits fenced by its epoch, and on stop
commits first and releases the lease second, so the next owner starts
exactly where this one ended.

When it has nothing to do it tells the Bus's IdlePoller (actors/poller.py)
where it stands; that actor looks at every idle worker of the process in one
statement per `max_poll_interval` and wakes those with messages past their
position, or whose lease was taken.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import asyncpg

from actors import metrics
from actors.committer import Commit
from actors.messages import (
    CheckLease,
    CommitDue,
    CoordinatorMessage,
    LeaseLost,
    NotifierMessage,
    PollerMessage,
    RetryDue,
    Rewind,
    Seek,
    Subscribe,
    Unsubscribe,
    Unwatch,
    Wake,
    Watch,
    WorkerFailed,
    WorkerMessage,
)
from actors.runtime import Actor, ActorRef, ActorStoppedError, AskTimeoutError, Timer
from storage import leases
from storage.availability import warn_unless_said
from storage.db import TRANSIENT_ERRORS, Lender, Now, server_clock
from storage.logs import get_logger
from storage.names import validate_int, validate_seconds

#: Handler mode: the shortest time between two commits of one partition (seconds). A position
#: handled meanwhile is committed by a timer at the end of the interval, or as the partition is let go.
COMMIT_INTERVAL = 0.2


@dataclass(frozen=True)
class Batch:
    """Fetched rows of one partition, tagged with the lease epoch they were read under."""

    topic: str
    partition: str
    partition_id: int
    epoch: int
    rows: list[asyncpg.Record]
    worker: ActorRef[WorkerMessage]


@dataclass(frozen=True)
class RetryPolicy:
    """How a handler failure is retried: `max_attempts` in all, backoff doubling from `backoff` seconds."""

    max_attempts: int = 3
    backoff: float = 0.5
    max_backoff: float = 30.0

    @classmethod
    def checked(
        cls, max_attempts: int, backoff: timedelta | float, max_backoff: timedelta | float
    ) -> RetryPolicy:
        """A policy from user input: ValidationError (saying what to pass) for anything out of range."""
        return cls(
            validate_int(max_attempts, "retry max_attempts", 1),
            validate_seconds(backoff, "retry backoff", allow_zero=True),
            validate_seconds(max_backoff, "retry max_backoff", allow_zero=True),
        )

    def delay(self, attempt: int) -> float:
        return float(min(self.max_backoff, self.backoff * (2 ** (attempt - 1))))


@dataclass(frozen=True)
class TxOutcome:
    """What a transactional handler's batch came to (`Sink.handle_transaction`).

    `committed`: the position committed with the handler's writes (None: the lease
    had moved on, nothing applied). `failed`: the index in the batch of the message
    that failed with `attempts` failed attempts so far (the offsets stop at it);
    `stopped`: its last attempt failed and there is no dead-letter topic.
    """

    committed: int | None
    failed: int | None = None
    attempts: int = 0
    stopped: BaseException | None = None


class Sink(Protocol):
    """Where a worker's messages go: the consumer's buffer (poll) or the user's handler (subscribe)."""

    handler_mode: bool
    transactional: bool
    retry: RetryPolicy

    def acquired(self, partition_id: int, epoch: int, worker: ActorRef[WorkerMessage]) -> None:
        """Poll mode: this worker holds the partition's lease of `epoch` (before any batch of it)."""

    def offer(self, batch: Batch) -> bool:
        """Poll mode: buffer the batch; False when the buffer is full (try again later)."""

    def consumed(self, partition_id: int, epoch: int) -> int | None:
        """Poll mode, auto-commit: the position the user has polled through (None: nothing to commit)."""

    def revoked(self, partition_id: int, epoch: int) -> None:
        """Drop whatever is buffered from this lease."""

    def released(self, partition_id: int, epoch: int, committed: int | None) -> None:
        """Poll mode: the lease ended; `committed` is the position the worker committed as it let go (None: none)."""

    async def handle(self, topic: str, partition: str, row: asyncpg.Record, attempt: int) -> None:
        """Handler mode: process one message (raise to retry)."""

    async def dead_letter(
        self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int
    ) -> bool:
        """Handler mode: send to the dead-letter topic; False when there is none."""

    def failed(self, topic: str, partition: str, error: BaseException) -> None:
        """Handler mode: the partition stopped on an error it could not get past."""

    async def handle_transaction(
        self, spec: WorkerSpec, epoch: int, rows: list[asyncpg.Record], now: datetime | None
    ) -> TxOutcome:
        """Transactional handler mode: handle `rows` and commit their offsets in one transaction."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a PartitionWorker needs to know, fixed for its life."""

    group: str
    member_id: str
    generation: int
    topic: str
    partition: str
    partition_id: int
    lease_time: float
    poll_interval: float
    fetch_size: int
    messages_channel: str
    now: Now = server_clock  # the time its lease is taken, renewed and judged at (the Bus's)


class PartitionWorker(Actor[WorkerMessage]):
    """Owns one partition for one member: lease, fetch, hand on, commit, release."""

    mailbox_size = 64

    def __init__(
        self,
        spec: WorkerSpec,
        pool: asyncpg.Pool,
        lender: Lender,
        sink: Sink,
        notifier: ActorRef[NotifierMessage],
        coordinator: ActorRef[CoordinatorMessage],
        poller: ActorRef[PollerMessage],
        committer: ActorRef[Commit] | None = None,
    ) -> None:
        self.spec = spec
        self._poller = poller  # the Bus's poll fallback of idle workers
        self._watch: tuple[int | None, int, bool] | None = None  # what the poller last heard
        self._again = False  # a Wake to this worker is queued: it is not idle
        self._pool = pool
        self._lender = lender  # the hot path's statements: fetch and commit
        self._sink = sink
        self._notifier = notifier
        self._coordinator = coordinator
        self._committer = committer  # handler mode: the member's commits go together through it
        self._epoch: int | None = None
        self._position = 0  # next offset to fetch
        self._committed = 0  # last committed position (handler mode)
        # Handler mode: the position handled through (committed at most every COMMIT_INTERVAL).
        self._handled = 0
        self._last_commit = 0.0  # loop time of the last commit write
        self._commit_timer: Timer | None = None
        self._pending: Batch | None = None
        self._fetch_size = spec.fetch_size
        # Handler mode: the rows left when a handler failed, and the next attempt number.
        self._retry: tuple[list[asyncpg.Record], int] | None = None
        self._retry_timer: Timer | None = None
        self._stopped_on_error = False
        # Transactional handler mode, after a database error: whether the last transaction
        # committed is unknown (a COMMIT whose reply was lost), so the position is read back
        # from the committed offset before anything is fetched again.
        self._reread = False
        self._log = get_logger(
            __name__,
            group=spec.group,
            member=spec.member_id,
            generation=spec.generation,
            topic=spec.topic,
            partition=spec.partition,
        )

    async def on_start(self) -> None:
        ref = self.self_ref
        # Asked, not told: the LISTEN is in place before the first look at the lease. A worker that
        # looked first could miss the NOTIFY of the previous owner's release, sent while this
        # process was still starting to LISTEN (its first workers in a join), and wait for the poll.
        subscribe = Subscribe(
            self.spec.messages_channel, str(self.spec.partition_id), ref, Wake(), catch_up=False
        )
        try:
            await self._notifier.ask(subscribe)
        except (AskTimeoutError, ActorStoppedError):
            self._log.warning("listen_not_confirmed")  # the poll fallback finds what a NOTIFY would tell
        self._wake()

    async def on_stop(self) -> None:
        self._notifier.signal(Unsubscribe(self.self_ref))
        self._poller.signal(Unwatch(self.self_ref))
        if self._epoch is None:
            return
        epoch, self._epoch = self._epoch, None
        committed: int | None = None
        try:
            self._cancel_commit_timer()
            if self._sink.handler_mode:
                position: int | None = max(self._committed, self._handled)
            else:
                position = self._sink.consumed(self.spec.partition_id, epoch)
                self._sink.revoked(self.spec.partition_id, epoch)
            async with self._pool.acquire() as conn, conn.transaction():  # commit then release: one flush
                if position is not None:
                    applied = await leases.commit(
                        conn,
                        self.spec.group,
                        self.spec.member_id,
                        [(self.spec.partition_id, position, epoch)],
                        self.spec.now(),
                    )
                    committed = position if applied else None
                await leases.release(
                    conn,
                    self.spec.group,
                    self.spec.partition_id,
                    self.spec.member_id,
                    epoch,
                    self.spec.messages_channel,
                )
            self._log.debug("partition_released", epoch=epoch, position=position)
        except TRANSIENT_ERRORS as exc:
            # The lease expires by itself; the next owner re-reads from the last commit.
            # (asyncpg's InternalClientError after a dropped connection is among them:
            # escaping from here it would fail the Coordinator's revoke.)
            committed = None
            self._log.warning("release_failed", error=str(exc))
        finally:
            if not self._sink.handler_mode:
                self._sink.released(self.spec.partition_id, epoch, committed)

    def _wake(self) -> None:
        """Queue a Wake to this worker (it stays busy until that Wake is handled)."""
        self._again = self.self_ref.signal(Wake()) or self._again

    def _report_idle(self) -> None:
        """Tell the poller where this worker stands, if that changed since it last heard.

        A worker with a Wake queued is not idle: it reports after that Wake. One without
        the lease, or with a batch the consumer's buffer refused, is woken at every poll.
        """
        if self._again or self._stopped_on_error:
            return
        watch = (self._epoch, self._position, self._epoch is None or self._pending is not None)
        if watch != self._watch and self._poller.signal(
            Watch(
                self.self_ref,
                self.spec.group,
                self.spec.member_id,
                self.spec.partition_id,
                watch[0],
                watch[1],
                self.spec.poll_interval,
                watch[2],
            )
        ):
            self._watch = watch

    async def receive(self, message: WorkerMessage) -> Any:
        if isinstance(message, Wake):
            self._again = False
        try:
            return await self._receive(message)
        finally:
            self._report_idle()

    async def _receive(self, message: WorkerMessage) -> Any:
        match message:
            case CheckLease():
                if self._epoch is not None:
                    try:
                        await self._check_lease()
                    except TRANSIENT_ERRORS as exc:
                        warn_unless_said(self._log, "lease_check_failed", exc)
            case Wake():
                try:
                    await self._work()
                except TRANSIENT_ERRORS as exc:
                    # The database is away (restart, failover, dropped connection):
                    # the next tick retries; the lease, if it ran out, is re-taken.
                    warn_unless_said(self._log, "fetch_failed", exc)
                    self._resume_from_committed()
            case Seek(offset=offset):
                if self._epoch is not None and not self._sink.handler_mode:
                    self._sink.revoked(self.spec.partition_id, self._epoch)
                self._pending = None
                self._position = offset
                self._wake()
            case Rewind():
                return await self._rewind()
            case RetryDue(epoch=epoch):
                try:
                    await self._retry_due(epoch)
                except TRANSIENT_ERRORS as exc:
                    warn_unless_said(self._log, "retry_failed", exc)
                    self._resume_from_committed()
            case CommitDue(epoch=epoch):
                self._commit_timer = None
                if epoch == self._epoch:
                    try:
                        await self._commit(self._handled)
                    except TRANSIENT_ERRORS as exc:
                        warn_unless_said(self._log, "commit_failed", exc)
                        self._resume_from_committed()
        return None

    async def _rewind(self) -> bool:
        """Go back to the committed offset: what was handed out past it comes again."""
        if self._epoch is not None and not self._sink.handler_mode:
            self._sink.revoked(self.spec.partition_id, self._epoch)
        self._pending = None
        if self._epoch is None:
            return True  # not holding the lease: acquiring it starts from the committed offset
        try:
            row = await leases.state(self._pool, self.spec.group, self.spec.partition_id, self.spec.now())
        except TRANSIENT_ERRORS as exc:
            warn_unless_said(self._log, "rewind_failed", exc)
            return False
        if row is None or row["owner"] != self.spec.member_id or row["lease_epoch"] != self._epoch:
            await self._lost()
            return True
        self._position = max(int(row["committed"]), int(row["log_start"]))
        self._committed = self._handled = self._position
        self._wake()
        return True

    async def _acquire(self) -> bool:
        got = await leases.acquire(
            self._pool,
            self.spec.group,
            self.spec.partition_id,
            self.spec.member_id,
            self.spec.generation,
            self.spec.lease_time,
            self.spec.now(),
        )
        if got is None:
            return False
        self._epoch, self._position = got
        self._committed = self._handled = self._position
        self._reread = False
        if not self._sink.handler_mode:
            self._sink.acquired(self.spec.partition_id, self._epoch, self.self_ref)
        self._log.debug("partition_acquired", epoch=self._epoch, position=self._position)
        return True

    async def _work(self) -> None:
        if self._stopped_on_error or self._retry is not None:
            return  # stopped, or a handler's backoff is running (RetryDue resumes)
        if self._reread and self._epoch is not None:
            if await self._rewind():  # the committed offset, or the lease is gone; it wakes us
                self._reread = False
            return
        if self._epoch is None and not await self._acquire():
            # The previous owner is still revoking (it commits, then releases);
            # its release NOTIFY or the next poll tick brings us back.
            return
        assert self._epoch is not None
        if self._pending is not None:
            if not self._sink.offer(self._pending):
                return
            self._pending = None
        limit = self._fetch_size
        rows = await leases.fetch(
            self._lender, self.spec.group, self.spec.partition_id, self.spec.member_id,
            self._epoch, self._position, limit, self.spec.now(),
        )  # fmt: skip
        # Fetch sizes follow the lag: a full fetch doubles the next one (up to 4x the
        # configured size), a short one goes back to the configured size.
        if len(rows) == limit:
            self._fetch_size = min(limit * 2, self.spec.fetch_size * 4)
        elif len(rows) < limit // 2:
            self._fetch_size = self.spec.fetch_size
        if not rows:
            return  # idle: the poller checks the lease of every idle worker of the process at once
        self._position = rows[-1]["offset"] + 1
        metrics.fetched(self.spec.group, self.spec.topic, len(rows))
        if self._sink.handler_mode:
            await self._run_handler(rows)
        else:
            batch = Batch(
                self.spec.topic, self.spec.partition, self.spec.partition_id, self._epoch, rows, self.self_ref
            )
            if not self._sink.offer(batch):
                self._pending = batch
                return
        if len(rows) == limit:
            self._wake()

    async def _check_lease(self) -> None:
        # On the hot path's lent connection: a pool acquire would add the pool's reset statement.
        row = await leases.state(self._lender, self.spec.group, self.spec.partition_id, self.spec.now())
        if (
            row is None
            or row["owner"] != self.spec.member_id
            or row["lease_epoch"] != self._epoch
            or not row["live"]
        ):
            await self._lost()

    async def _lost(self) -> None:
        self._log.info("lease_lost", epoch=self._epoch)
        metrics.lease_lost(self.spec.group, self.spec.topic)
        if not self._sink.handler_mode and self._epoch is not None:
            self._sink.revoked(self.spec.partition_id, self._epoch)
            self._sink.released(self.spec.partition_id, self._epoch, None)
        self._epoch = None
        self._pending = None
        self._cancel_retry()
        self._coordinator.signal(LeaseLost(self.spec.partition_id))

    def _resume_from_committed(self) -> None:
        """Handler mode, after a database error: start again after the last message handled.

        The position already points past the fetched batch; whatever of it was
        not handled (a handler's retry, a dead-letter publish or a fetch failed on
        the lost connection) must come again, not be skipped. What was handled
        stays handled: it is not handed to the handler again, and the commit
        timer is set again for it (a commit that failed is retried). Had the lease
        been lost meanwhile, its next owner reads from the committed offset
        (at-least-once).
        """
        if self._sink.handler_mode:
            self._cancel_retry()
            self._cancel_commit_timer()
            self._position = self._handled
            if self._sink.transactional:
                self._reread = True  # its transaction may have committed: the database says where it is
            if self._epoch is not None and self._handled > self._committed:
                self._commit_timer = self.self_ref.schedule_once(COMMIT_INTERVAL, CommitDue(self._epoch))

    def _cancel_retry(self) -> None:
        self._retry = None
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None

    async def _run_handler(self, rows: list[asyncpg.Record], attempt: int = 1) -> None:
        """Hand `rows` to the handler in order; `attempt` is the first row's attempt number.

        A failure with attempts left schedules a RetryDue after the backoff and
        returns: the worker stays responsive (a revoke or stop never waits
        behind a backoff), fetches nothing new meanwhile, and resumes at that
        row when the timer fires.
        """
        assert self._epoch is not None
        if self._sink.transactional:
            await self._run_transactional(rows)
            return
        done = self._committed
        for index, row in enumerate(rows):
            while True:
                try:
                    await self._sink.handle(self.spec.topic, self.spec.partition, row, attempt)
                    break
                except Exception as exc:  # the user's handler: anything may come out
                    metrics.handler_error(self.spec.group, self.spec.topic)
                    if attempt < self._sink.retry.max_attempts:
                        self._log.info(
                            "handler_retry", offset=row["offset"], attempt=attempt, error=repr(exc)
                        )
                        await self._commit(done)
                        self._retry = (rows[index:], attempt + 1)
                        self._retry_timer = self.self_ref.schedule_once(
                            self._sink.retry.delay(attempt), RetryDue(self._epoch)
                        )
                        return
                    if await self._sink.dead_letter(self.spec.topic, self.spec.partition, row, exc, attempt):
                        self._log.warning(
                            "dead_lettered", offset=row["offset"], attempts=attempt, error=repr(exc)
                        )
                        metrics.dead_lettered(self.spec.group, self.spec.topic)
                        break
                    # No dead-letter topic: stop this partition where it is; the
                    # failed message stays uncommitted for whoever fixes and resumes.
                    self._log.error(
                        "partition_stopped", offset=row["offset"], attempts=attempt, error=repr(exc)
                    )
                    await self._commit(done)
                    self._stopped_on_error = True
                    self._sink.failed(self.spec.topic, self.spec.partition, exc)
                    self._coordinator.signal(WorkerFailed(self.spec.partition_id, repr(exc)))
                    return
            attempt = 1
            done = row["offset"] + 1
        await self._commit_soon(done)

    async def _run_transactional(self, rows: list[asyncpg.Record]) -> None:
        """Hand `rows` to a transactional handler: its writes and the offsets commit together.

        The attempts of a failing message are counted in the database, in that
        transaction; a retry re-runs from the failing message after the backoff.
        """
        assert self._epoch is not None
        epoch = self._epoch
        out = await self._sink.handle_transaction(self.spec, epoch, rows, self.spec.now())
        if out.committed is None:
            self._position = self._handled  # nothing applied: the new owner (or this one) reads again
            await self._check_lease()
            return
        self._last_commit = asyncio.get_running_loop().time()
        self._committed = self._handled = max(self._committed, out.committed)
        if out.failed is None:
            return
        row = rows[out.failed]
        metrics.handler_error(self.spec.group, self.spec.topic)
        if out.stopped is not None:
            self._log.error(
                "partition_stopped", offset=row["offset"], attempts=out.attempts, error=repr(out.stopped)
            )
            self._stopped_on_error = True
            self._sink.failed(self.spec.topic, self.spec.partition, out.stopped)
            self._coordinator.signal(WorkerFailed(self.spec.partition_id, repr(out.stopped)))
            return
        self._retry = (rows[out.failed :], out.attempts + 1)
        self._retry_timer = self.self_ref.schedule_once(self._sink.retry.delay(out.attempts), RetryDue(epoch))

    async def _retry_due(self, epoch: int) -> None:
        if self._retry is None or epoch != self._epoch:
            return  # the lease changed since: the new lease starts from the committed offset
        rows, attempt = self._retry
        self._retry = None
        await self._run_handler(rows, attempt)
        if self._retry is None and not self._stopped_on_error:
            self._wake()

    async def _commit_soon(self, position: int) -> None:
        """Handler mode, after a batch: commit now if the last commit is COMMIT_INTERVAL old, else on a timer.

        Every commit writes a new version of the group's cursor row; at one
        commit per message a busy partition writes hundreds a second, and an old
        snapshot held by any session keeps every one of them (each later read
        of the row walks them all). Coalescing bounds the versions to a few per
        second; what was handled and not yet committed is committed when the
        timer fires or the partition is let go, and comes again only after a
        crash in between (at-least-once, as any uncommitted message).
        """
        self._handled = max(self._handled, position)
        if self._epoch is None or position <= self._committed:
            return
        wait = self._last_commit + COMMIT_INTERVAL - asyncio.get_running_loop().time()
        if wait <= 0:
            await self._commit(position)
        elif self._commit_timer is None:
            self._commit_timer = self.self_ref.schedule_once(wait, CommitDue(self._epoch))

    def _cancel_commit_timer(self) -> None:
        if self._commit_timer is not None:
            self._commit_timer.cancel()
            self._commit_timer = None

    async def _commit(self, position: int) -> None:
        if self._epoch is None or position <= self._committed:
            return
        self._last_commit = asyncio.get_running_loop().time()
        if await self._commit_applied(position, self._epoch):
            self._committed = position
        else:
            await self._check_lease()

    async def _commit_applied(self, position: int, epoch: int) -> bool:
        """Commit through the member's Committer (one statement with its other workers' commits).

        Bounded by the lease time (TimeoutError is a database error: the caller resumes from the
        last commit); with no Committer, or one that stopped, the worker writes its commit itself.
        """
        spec, committer = self.spec, self._committer
        if committer is not None and committer.is_alive:
            reply: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(spec.lease_time):
                    await committer.tell(Commit(spec.member_id, spec.partition_id, position, epoch, reply))
                    return await reply
            except ActorStoppedError:
                pass  # the member is stopping, or the Committer gave up: write it here
        applied = await leases.commit(
            self._lender, spec.group, spec.member_id, [(spec.partition_id, position, epoch)], spec.now()
        )
        return spec.partition_id in applied
