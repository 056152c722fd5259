"""The Coordinator: one per local group member.

It joins the group, learns generation and assignment (from the batched
heartbeat's read-back or a NOTIFY on the group), and makes the local
PartitionWorkers match the assignment: partitions that stay keep their
worker (incremental rebalancing: they never stop), partitions that leave are
revoked (the user's on_revoke, then the worker commits and releases),
partitions that arrive get a new worker. On stop it revokes everything and
leaves the group. In handler mode a Committer (actors/committer.py), a child
beside the workers, coalesces the workers' commits into one statement.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import asyncpg

from actors import metrics
from actors.committer import Commit, Committer
from actors.messages import (
    CoordinatorMessage,
    GroupChanged,
    HeartbeatReply,
    LeaderSeen,
    LeaseLost,
    MemberFenced,
    MonitorMessage,
    NotifierMessage,
    PollerMessage,
    RegisterMember,
    Subscribe,
    Sync,
    UnregisterMember,
    Unsubscribe,
    WorkerFailed,
    WorkerMessage,
)
from actors.runtime import Actor, ActorRef, RestartStrategy, Supervisor
from actors.worker import PartitionWorker, Sink, WorkerSpec
from storage import membership
from storage.availability import is_unavailable, warn_unless_said
from storage.db import TRANSIENT_ERRORS, Lender, Now, server_clock
from storage.logs import get_logger


class MemberSink(Sink, Protocol):
    """A Sink that also hears about assignment changes (the consumer or subscription)."""

    async def on_assign(self, partitions: set[tuple[str, str]]) -> None: ...

    async def on_revoke(self, partitions: set[tuple[str, str]]) -> None: ...

    def on_member(self, member_id: str, generation: int) -> None: ...

    def on_joined(self, member_id: str) -> None: ...

    def on_error(self, error: str) -> None: ...


@dataclass(frozen=True)
class MemberSpec:
    """Who this member is and how it behaves."""

    group: str
    topics: tuple[str, ...]  # empty: every topic of the group (wildcard)
    instance_id: str | None
    client_id: str
    session_timeout: float
    rebalance_delay: float
    lease_time: float
    poll_interval: float
    fetch_size: int
    groups_channel: str
    messages_channel: str
    now: Now = server_clock  # the time its session and its workers' leases are judged by (the Bus's)


class Coordinator(Actor[CoordinatorMessage]):
    """Owns one member's membership and its PartitionWorkers."""

    mailbox_size = 256

    def __init__(
        self,
        spec: MemberSpec,
        pool: asyncpg.Pool,
        lender: Lender,
        sink: MemberSink,
        notifier: ActorRef[NotifierMessage],
        monitor: ActorRef[MonitorMessage],
        poller: ActorRef[PollerMessage],
        rejoin: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.spec = spec
        self._poller = poller  # the Bus's poll fallback of idle workers
        self._pool = pool
        self._lender = lender
        self._sink = sink
        self._sync_due = False  # a retry Sync is scheduled (after a database error)
        self._notifier = notifier
        self._monitor = monitor
        self.member_id = ""
        self.generation = -1
        self._workers: dict[int, tuple[tuple[str, str], ActorRef[WorkerMessage]]] = {}
        self._failed: set[int] = set()
        self._names = itertools.count()
        self._worker_names: dict[str, int] = {}  # supervisor child name -> partition id
        self._supervisor: Supervisor | None = None
        self._committer: ActorRef[Commit] | None = None  # handler mode: the workers' commits, coalesced
        self._log = get_logger(__name__, group=spec.group)

    # -- lifecycle -----------------------------------------------------------------

    async def on_start(self) -> None:
        self._supervisor = Supervisor(
            f"workers-{self.spec.group}",
            on_escalate=self._worker_gave_up,
            strategy=RestartStrategy(max_restarts=5, within=30.0, backoff_initial=0.1, backoff_max=5.0),
            outage=is_unavailable,  # a worker waits out the database's outage, however long
            clock=self.clock,
        )
        if self._sink.handler_mode:
            lender, spec = self._lender, self.spec
            self._committer = self._supervisor.spawn(
                lambda: Committer(lender, spec.group, spec.lease_time / 2, spec.now), "committer"
            )
        await self._join()
        self._notifier.signal(
            Subscribe(self.spec.groups_channel, self.spec.group, self.self_ref, GroupChanged())
        )
        self.self_ref.signal(Sync())

    async def on_stop(self) -> None:
        self._notifier.signal(Unsubscribe(self.self_ref))
        await self._revoke(set(self._workers))
        if self._supervisor is not None:
            await self._supervisor.stop()
        self._monitor.signal(UnregisterMember(self.spec.group, self.member_id))
        if self.spec.instance_id is None:
            try:
                async with self._pool.acquire() as conn:
                    await membership.leave(
                        conn,
                        self.spec.group,
                        self.member_id,
                        self.spec.rebalance_delay,
                        self.spec.groups_channel,
                    )
            except TRANSIENT_ERRORS as exc:
                # Unreachable database: the session expires and the sweep removes us.
                self._log.warning("leave_failed", error=repr(exc))
                return
        self._log.info("member_left", member=self.member_id)

    async def _join(self) -> None:
        # A static member keeps its id across restarts: same row, same partitions.
        self.member_id = (
            f"static-{self.spec.instance_id}" if self.spec.instance_id else f"m-{uuid.uuid4().hex[:12]}"
        )
        async with self._pool.acquire() as conn:
            row = await membership.join(
                conn,
                membership.JoinParams(
                    group=self.spec.group,
                    member_id=self.member_id,
                    instance_id=self.spec.instance_id,
                    client_id=self.spec.client_id,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    topics=list(self.spec.topics),
                    session_timeout=self.spec.session_timeout,
                    rebalance_delay=self.spec.rebalance_delay,
                    now=self.spec.now(),
                ),
            )
        self._log = get_logger(__name__, group=self.spec.group, member=self.member_id)
        self._log.info("member_joined", rejoined=row["rejoined"], leader=row["leader"])
        self._sink.on_joined(self.member_id)
        await self._monitor.tell(RegisterMember(self.spec.group, self.member_id, self.self_ref))
        self._monitor.signal(LeaderSeen(self.spec.group, row["leader"]))

    def _worker_gave_up(self, name: str, exc: BaseException) -> None:
        pid = self._worker_names.get(name)
        if pid is not None:
            self.self_ref.signal(WorkerFailed(pid, repr(exc)))

    # -- messages ------------------------------------------------------------------

    async def receive(self, message: CoordinatorMessage) -> None:
        if isinstance(message, Sync):
            self._sync_due = False
        try:
            await self._receive(message)
        except TRANSIENT_ERRORS as exc:
            # A heartbeat reply brings another Sync only when the generation moved, and a
            # NOTIFY only when the group changes: after a lost lease in a stable group neither
            # comes, so the retry is scheduled here (one at a time).
            warn_unless_said(self._log, "coordinator_retry_later", exc)
            if not self._sync_due:
                self._sync_due = True
                self.self_ref.schedule_once(self.spec.rebalance_delay + 0.5, Sync())

    async def on_failure(self, exc: BaseException) -> None:
        # A restart joins as a new member: let go of this one's workers and registration.
        self._monitor.signal(UnregisterMember(self.spec.group, self.member_id))
        self._notifier.signal(Unsubscribe(self.self_ref))
        if self._supervisor is not None:
            await self._supervisor.stop()

    async def _receive(self, message: CoordinatorMessage) -> None:
        match message:
            case HeartbeatReply(member_generation=gen):
                if gen != self.generation:
                    await self._sync()
            case GroupChanged() | Sync():
                await self._sync()
            case LeaseLost(partition_id=pid):
                await self._stop_workers({pid}, revoke_callback=False)
                await self._sync()
            case WorkerFailed(partition_id=pid, error=error):
                self._failed.add(pid)
                self._sink.on_error(error)
            case MemberFenced(member_id=fenced) if fenced and fenced != self.member_id:
                # A notice about an identity already replaced (queued before the rejoin):
                # acting on it would fence the new member too and leave it orphaned.
                self._log.debug("stale_fence_ignored", fenced=fenced)
            case MemberFenced():
                self._log.warning("member_fenced", generation=self.generation)
                await self._stop_workers(set(self._workers), revoke_callback=True)
                self._monitor.signal(UnregisterMember(self.spec.group, self.member_id))
                self.generation = -1
                try:
                    await self._join()
                except TRANSIENT_ERRORS:
                    # Not joined: no heartbeat reply or NOTIFY will come for an id never
                    # registered, so nothing else would retry; try again shortly.
                    self.self_ref.schedule_once(self.spec.rebalance_delay + 0.5, MemberFenced(self.member_id))
                    raise
                await self._sync()

    async def _sync(self) -> None:
        row = await membership.assignment(self._pool, self.spec.group, self.member_id)
        if row is None:
            self.self_ref.signal(MemberFenced(self.member_id))
            return
        self._monitor.signal(LeaderSeen(self.spec.group, row["leader"]))
        generation = int(row["generation"])
        wanted = set(row["assignment"])
        current = set(self._workers)
        leaving = current - wanted
        arriving = wanted - current - self._failed
        if leaving:
            await self._revoke(leaving)
        if generation != self.generation:
            self.generation = generation
            self._sink.on_member(self.member_id, generation)
            self._log.info("assignment", generation=generation, partitions=len(wanted))
        if arriving:
            names = await membership.partition_names(self._pool, sorted(arriving))
            for pid in sorted(arriving):
                if pid in names:
                    self._start_worker(pid, names[pid])
            await self._callback(self._sink.on_assign, {names[p] for p in arriving if p in names})
            metrics.assigned(self.spec.group, len([p for p in arriving if p in names]))
        self._failed &= wanted

    async def _callback(
        self, fn: Callable[[set[tuple[str, str]]], Awaitable[None]], tps: set[tuple[str, str]]
    ) -> None:
        # The user's on_assign/on_revoke: its failure is reported, never fatal to membership.
        try:
            await fn(tps)
        except Exception as exc:
            self._log.error("rebalance_callback_failed", error=repr(exc))
            self._sink.on_error(f"{getattr(fn, '__name__', 'callback')} raised {exc!r}")

    def _start_worker(self, pid: int, tp: tuple[str, str]) -> None:
        assert self._supervisor is not None
        spec = WorkerSpec(
            group=self.spec.group,
            member_id=self.member_id,
            generation=self.generation,
            topic=tp[0],
            partition=tp[1],
            partition_id=pid,
            lease_time=self.spec.lease_time,
            poll_interval=self.spec.poll_interval,
            fetch_size=self.spec.fetch_size,
            messages_channel=self.spec.messages_channel,
            now=self.spec.now,
        )
        name = f"worker-{pid}-{next(self._names)}"
        self._worker_names[name] = pid
        committer, poller = self._committer, self._poller
        ref = self._supervisor.spawn(
            lambda: PartitionWorker(
                spec, self._pool, self._lender, self._sink, self._notifier, self.self_ref, poller, committer
            ),
            name,
        )
        self._workers[pid] = (tp, ref)

    async def _revoke(self, pids: set[int]) -> None:
        await self._stop_workers(pids, revoke_callback=True)

    async def _stop_workers(self, pids: set[int], *, revoke_callback: bool) -> None:
        pids = pids & set(self._workers)
        if not pids:
            return
        if revoke_callback:
            # The user's on_revoke runs while the leases are still held, so a
            # manual commit inside it still applies.
            await self._callback(self._sink.on_revoke, {self._workers[p][0] for p in pids})
        metrics.revoked(self.spec.group, len(pids))
        # In parallel: each worker commits and releases on its own; the next owners wait on all of them.
        refs = [self._workers.pop(pid)[1] for pid in sorted(pids)]
        for ref in refs:
            self._worker_names.pop(ref.name, None)
        await asyncio.gather(*(ref.stop(drain=False) for ref in refs))
