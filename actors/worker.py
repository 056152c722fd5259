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

from typing import Any

import asyncpg

from actors import metrics
from actors.committer import Commit
from actors.handler_runner import COMMIT_INTERVAL, HandlerRunner
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
    WorkerMessage,
)
from actors.runtime import Actor, ActorRef, ActorStoppedError, AskTimeoutError
from actors.sink import Batch, RetryPolicy, Sink, TxOutcome, WorkerSpec
from storage import leases
from storage.availability import warn_unless_said
from storage.db import TRANSIENT_ERRORS, Lender
from storage.logs import get_logger

# Where the Bus and the Coordinator import them from.
__all__ = [
    "COMMIT_INTERVAL",
    "Batch",
    "PartitionWorker",
    "RetryPolicy",
    "Sink",
    "TxOutcome",
    "WorkerSpec",
]


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
        self._epoch: int | None = None
        self._position = 0  # next offset to fetch
        self._pending: Batch | None = None
        self._fetch_size = spec.fetch_size
        self._log = get_logger(
            __name__,
            group=spec.group,
            member=spec.member_id,
            generation=spec.generation,
            topic=spec.topic,
            partition=spec.partition,
        )
        # Handler mode: the handler, its retries and the commits (poll mode: the consumer commits).
        self._handler = (
            HandlerRunner(spec, sink, self, lender, coordinator, committer, self._log)
            if sink.handler_mode
            else None
        )

    @property
    def epoch(self) -> int | None:
        """The epoch of the lease this worker holds (None: it holds none)."""
        return self._epoch

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
            if self._handler is not None:
                self._handler.cancel_commit_timer()
                position: int | None = max(self._handler.committed, self._handler.handled)
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
            if self._handler is None:
                self._sink.released(self.spec.partition_id, epoch, committed)

    def _wake(self) -> None:
        """Queue a Wake to this worker (it stays busy until that Wake is handled)."""
        self._again = self.self_ref.signal(Wake()) or self._again

    def _report_idle(self) -> None:
        """Tell the poller where this worker stands, if that changed since it last heard.

        A worker with a Wake queued is not idle: it reports after that Wake. One without
        the lease, or with a batch the consumer's buffer refused, is woken at every poll.
        """
        if self._again or (self._handler is not None and self._handler.stopped_on_error):
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
                        await self.check_lease()
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
                if self._epoch is not None and self._handler is None:
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
            case CommitDue(epoch=epoch) if self._handler is not None:
                try:
                    await self._handler.commit_due(epoch)
                except TRANSIENT_ERRORS as exc:
                    warn_unless_said(self._log, "commit_failed", exc)
                    self._resume_from_committed()
        return None

    async def _rewind(self) -> bool:
        """Go back to the committed offset: what was handed out past it comes again."""
        if self._epoch is not None and self._handler is None:
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
        if self._handler is not None:
            self._handler.start_at(self._position)
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
        if self._handler is not None:
            self._handler.start_at(self._position)
            self._handler.reread = False
        else:
            self._sink.acquired(self.spec.partition_id, self._epoch, self.self_ref)
        self._log.debug("partition_acquired", epoch=self._epoch, position=self._position)
        return True

    async def _work(self) -> None:
        handler = self._handler
        if handler is not None and handler.waiting:
            return  # stopped, or a handler's backoff is running (RetryDue resumes)
        if handler is not None and handler.reread and self._epoch is not None:
            if await self._rewind():  # the committed offset, or the lease is gone; it wakes us
                handler.reread = False
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
        if handler is not None:
            await self._run_handler(handler, rows)
        else:
            batch = Batch(
                self.spec.topic, self.spec.partition, self.spec.partition_id, self._epoch, rows, self.self_ref
            )
            if not self._sink.offer(batch):
                self._pending = batch
                return
        if len(rows) == limit:
            self._wake()

    async def check_lease(self) -> None:
        """Read the lease; if it was taken (or ran out), let the partition go."""
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
        if self._handler is None and self._epoch is not None:
            self._sink.revoked(self.spec.partition_id, self._epoch)
            self._sink.released(self.spec.partition_id, self._epoch, None)
        self._epoch = None
        self._pending = None
        if self._handler is not None:
            self._handler.cancel_retry()
        self._coordinator.signal(LeaseLost(self.spec.partition_id))

    def _resume_from_committed(self) -> None:
        """Handler mode, after a database error: start again after the last message handled."""
        if self._handler is not None:
            self._position = self._handler.resume_from_committed()

    async def _run_handler(
        self, handler: HandlerRunner, rows: list[asyncpg.Record], attempt: int = 1
    ) -> None:
        """Hand `rows` to the handler; a transactional batch that applied nothing is fetched again."""
        again = await handler.run(rows, attempt)
        if again is not None:
            self._position = again

    async def _retry_due(self, epoch: int) -> None:
        handler = self._handler
        retry = handler.due_retry(epoch) if handler is not None else None
        if handler is None or retry is None:
            return  # the lease changed since: the new lease starts from the committed offset
        await self._run_handler(handler, *retry)
        if not handler.waiting:
            self._wake()
