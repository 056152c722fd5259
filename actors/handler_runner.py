"""Handler mode of a PartitionWorker: the user's handler, its retries and dead letters, and the commits.

A worker whose sink runs a handler (`Bus.subscribe`, not `poll`) builds one
HandlerRunner and hands it every batch it fetches. The runner is part of that
worker, not an actor of its own: it runs only in the worker's task, the
messages of its timers (`RetryDue`, `CommitDue`) reach the worker's mailbox
and the worker passes them on, and it sees the worker's lease through
`LeaseHolder`. It owns what only handler mode has: the positions handled and
committed, commit coalescing, the backoff between attempts, the dead-letter and
stop decisions, and the transactional path (`Sink.handle_transaction`).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import asyncpg

from actors import metrics
from actors.committer import Commit
from actors.messages import CommitDue, CoordinatorMessage, RetryDue, WorkerFailed, WorkerMessage
from actors.runtime import ActorRef, ActorStoppedError, Timer, TimeSource
from actors.sink import Sink, WorkerSpec
from storage import leases
from storage.db import Lender
from storage.logs import Logger

#: Handler mode: the shortest time between two commits of one partition (seconds). A position
#: handled meanwhile is committed by a timer at the end of the interval, or as the partition is let go.
COMMIT_INTERVAL = 0.2


class LeaseHolder(Protocol):
    """The worker that owns a HandlerRunner, as the runner sees it: its lease and its mailbox."""

    @property
    def epoch(self) -> int | None:
        """The epoch of the lease it holds (None: it holds none)."""

    @property
    def self_ref(self) -> ActorRef[WorkerMessage]:
        """Where the runner's timers send their messages."""

    @property
    def clock(self) -> TimeSource:
        """The time the runner's timers run on and its commit interval is measured by."""

    async def check_lease(self) -> None:
        """Read the lease; if it was taken, let the partition go."""


class HandlerRunner:
    """Hands one partition's fetched rows to the handler in order, retries, dead-letters, commits."""

    def __init__(
        self,
        spec: WorkerSpec,
        sink: Sink,
        worker: LeaseHolder,
        lender: Lender,
        coordinator: ActorRef[CoordinatorMessage],
        committer: ActorRef[Commit] | None,
        log: Logger,
    ) -> None:
        self.spec = spec
        self._sink = sink
        self._worker = worker
        self._lender = lender  # the hot path's statements: commit
        self._coordinator = coordinator
        self._committer = committer  # the member's commits go together through it
        self._log = log
        self.committed = 0  # last committed position
        self.handled = 0  # the position handled through (committed at most every COMMIT_INTERVAL)
        self._last_commit = 0.0  # the worker's clock at the last commit write
        self._commit_timer: Timer | None = None
        # The rows left when a handler failed, and the next attempt number.
        self._retry: tuple[list[asyncpg.Record], int] | None = None
        self._retry_timer: Timer | None = None
        self.stopped_on_error = False
        # Transactional handler mode, after a database error: whether the last transaction
        # committed is unknown (a COMMIT whose reply was lost), so the position is read back
        # from the committed offset before anything is fetched again.
        self.reread = False

    @property
    def waiting(self) -> bool:
        """Stopped on an error, or a handler's backoff is running (RetryDue resumes): fetch nothing."""
        return self.stopped_on_error or self._retry is not None

    def start_at(self, position: int) -> None:
        """The lease was taken, or the worker went back, at `position`: handled and committed through it."""
        self.committed = self.handled = position

    def resume_from_committed(self) -> int:
        """After a database error: where the worker fetches from again (after the last message handled).

        The position already points past the fetched batch; whatever of it was
        not handled (a handler's retry, a dead-letter publish or a fetch failed on
        the lost connection) must come again, not be skipped. What was handled
        stays handled: it is not handed to the handler again, and the commit
        timer is set again for it (a commit that failed is retried). Had the lease
        been lost meanwhile, its next owner reads from the committed offset
        (at-least-once).
        """
        self.cancel_retry()
        self.cancel_commit_timer()
        if self._sink.transactional:
            self.reread = True  # its transaction may have committed: the database says where it is
        epoch = self._worker.epoch
        if epoch is not None and self.handled > self.committed:
            self._commit_timer = self._worker.self_ref.schedule_once(COMMIT_INTERVAL, CommitDue(epoch))
        return self.handled

    def cancel_retry(self) -> None:
        self._retry = None
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None

    async def run(self, rows: list[asyncpg.Record], attempt: int = 1) -> int | None:
        """Hand `rows` to the handler in order; `attempt` is the first row's attempt number.

        A failure with attempts left schedules a RetryDue after the backoff and
        returns: the worker stays responsive (a revoke or stop never waits
        behind a backoff), fetches nothing new meanwhile, and resumes at that
        row when the timer fires. Returns the position to fetch from again when
        a transactional batch applied nothing (None: carry on).
        """
        assert self._worker.epoch is not None
        if self._sink.transactional:
            return await self._run_transactional(rows, self._worker.epoch)
        done = self.committed
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
                        await self.commit(done)
                        epoch = self._worker.epoch
                        if epoch is None:  # the lease went while committing: its next holder retries
                            return None
                        self._retry = (rows[index:], attempt + 1)
                        self._retry_timer = self._worker.self_ref.schedule_once(
                            self._sink.retry.delay(attempt), RetryDue(epoch)
                        )
                        return None
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
                    await self.commit(done)
                    self._stop_on(exc)
                    return None
            attempt = 1
            done = row["offset"] + 1
        await self._commit_soon(done)
        return None

    async def _run_transactional(self, rows: list[asyncpg.Record], epoch: int) -> int | None:
        """Hand `rows` to a transactional handler: its writes and the offsets commit together.

        The attempts of a failing message are counted in the database, in that
        transaction; a retry re-runs from the failing message after the backoff.
        """
        out = await self._sink.handle_transaction(self.spec, epoch, rows, self.spec.now())
        if out.committed is None:
            # Nothing applied: the new owner (or this one) reads again from what was handled.
            await self._worker.check_lease()
            return self.handled
        self._last_commit = self._worker.clock.monotonic()
        self.committed = self.handled = max(self.committed, out.committed)
        if out.failed is None:
            return None
        row = rows[out.failed]
        metrics.handler_error(self.spec.group, self.spec.topic)
        if out.stopped is not None:
            self._log.error(
                "partition_stopped", offset=row["offset"], attempts=out.attempts, error=repr(out.stopped)
            )
            self._stop_on(out.stopped)
            return None
        self._retry = (rows[out.failed :], out.attempts + 1)
        self._retry_timer = self._worker.self_ref.schedule_once(
            self._sink.retry.delay(out.attempts), RetryDue(epoch)
        )
        return None

    def _stop_on(self, error: BaseException) -> None:
        """The partition stops where it is: the handler failed for good and there is no dead-letter topic."""
        self.stopped_on_error = True
        self._sink.failed(self.spec.topic, self.spec.partition, error)
        self._coordinator.signal(WorkerFailed(self.spec.partition_id, repr(error)))

    def due_retry(self, epoch: int) -> tuple[list[asyncpg.Record], int] | None:
        """The rows and attempt a RetryDue of `epoch` resumes at (None: the lease changed since, or nothing waits)."""
        if self._retry is None or epoch != self._worker.epoch:
            return None  # the lease changed since: the new lease starts from the committed offset
        retry, self._retry = self._retry, None
        return retry

    async def commit_due(self, epoch: int) -> None:
        """The commit interval is over: commit what was handled, if the lease of `epoch` is still held."""
        self._commit_timer = None
        if epoch == self._worker.epoch:
            await self.commit(self.handled)

    async def _commit_soon(self, position: int) -> None:
        """After a batch: commit now if the last commit is COMMIT_INTERVAL old, else on a timer.

        Every commit writes a new version of the group's cursor row; at one
        commit per message a busy partition writes hundreds a second, and an old
        snapshot held by any session keeps every one of them (each later read
        of the row walks them all). Coalescing bounds the versions to a few per
        second; what was handled and not yet committed is committed when the
        timer fires or the partition is let go, and comes again only after a
        crash in between (at-least-once, as any uncommitted message).
        """
        self.handled = max(self.handled, position)
        epoch = self._worker.epoch
        if epoch is None or position <= self.committed:
            return
        wait = self._last_commit + COMMIT_INTERVAL - self._worker.clock.monotonic()
        if wait <= 0:
            await self.commit(position)
        elif self._commit_timer is None:
            self._commit_timer = self._worker.self_ref.schedule_once(wait, CommitDue(epoch))

    def cancel_commit_timer(self) -> None:
        if self._commit_timer is not None:
            self._commit_timer.cancel()
            self._commit_timer = None

    async def commit(self, position: int) -> None:
        epoch = self._worker.epoch
        if epoch is None or position <= self.committed:
            return
        self._last_commit = self._worker.clock.monotonic()
        if await self._commit_applied(position, epoch):
            self.committed = position
        else:
            await self._worker.check_lease()

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
