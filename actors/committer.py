"""The Committer: one per handler-mode member; its PartitionWorkers' commits, coalesced.

A subscription's worker commits after each batch it handled. While a commit
statement is out, the commits other workers of the member ask for gather
here, and the next statement carries them all: one fenced statement
(`storage.leases.commit`) for every partition that finished a batch
meanwhile, as a Kafka consumer sends one offset commit for all of its
partitions. Fencing stays per partition (its lease epoch): each worker
learns whether its own partition's commit applied.

One write at a time, each bounded by `timeout`: a write that does not end
(a connection left half-dead by a database restart) fails its commits with
TimeoutError, which workers treat as any database error (they resume from
their last commit), and the next write goes on. Nothing waits behind a
write for longer than that, and a worker that finds the Committer stopped
commits by itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

from actors.runtime import Actor, ActorStoppedError, Message
from storage import leases
from storage.availability import warn_unless_said
from storage.db import Lender, Now, server_clock
from storage.logs import get_logger


class Commit(Message, frozen=True):
    """Commit `position` of partition `partition_id` under lease `epoch`; `reply` gets whether it applied.

    In-process only: `reply` is an asyncio Future[bool], never encoded.
    """

    member_id: str
    partition_id: int
    position: int
    epoch: int
    reply: Any


class Committer(Actor[Commit]):
    """Coalesces a member's handler-mode commits: one fenced statement per write, one write at a time."""

    mailbox_size = 4096

    def __init__(self, lender: Lender, group: str, timeout: float, now: Now = server_clock) -> None:
        self._lender = lender
        self._group = group
        self._timeout = timeout
        self._now = now  # the time the leases are judged live at (the Bus's)
        self._pending: list[Commit] = []
        self._writing: asyncio.Task[None] | None = None
        self._stopping = False
        self._log = get_logger(__name__, actor="committer", group=group)

    async def receive(self, message: Commit) -> None:
        if not message.reply.done():  # else the worker gave up waiting before its turn
            self._pending.append(message)
        if self._writing is None:
            self._start()

    async def on_stop(self) -> None:
        """Let the write in flight end (bounded by the timeout), then fail what is left."""
        self._stopping = True
        if self._writing is not None:
            await asyncio.wait({self._writing})
        self._fail(ActorStoppedError("the member is stopping; commit from the worker itself"))

    async def on_failure(self, exc: BaseException) -> None:
        self._stopping = True
        if self._writing is not None:
            self._writing.cancel()
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, []
        for commit in pending:
            if not commit.reply.done():
                commit.reply.set_exception(exc)

    def _start(self) -> None:
        if self._stopping or not self._pending:
            return
        batch, self._pending = self._pending, []
        # A task of its own (not eager): the timeout inside must belong to the write.
        self._writing = asyncio.get_running_loop().create_task(self._write(batch), name="committer-write")

    async def _write(self, batch: list[Commit]) -> None:
        try:
            by_member: dict[str, list[Commit]] = {}
            for commit in batch:
                by_member.setdefault(commit.member_id, []).append(commit)
            for member_id, commits in by_member.items():
                await self._apply(member_id, commits)
        finally:
            self._writing = None
            self._start()  # what arrived meanwhile goes now

    async def _apply(self, member_id: str, commits: list[Commit]) -> None:
        # A worker that gave up waiting may have asked again: one entry per lease, the furthest position.
        furthest: dict[tuple[int, int], int] = {}
        for c in commits:
            lease = (c.partition_id, c.epoch)
            furthest[lease] = max(furthest.get(lease, c.position), c.position)
        # The statement says which partitions applied, not under which epoch: a partition asked
        # for under two leases (an old worker's commit late beside its successor's) goes in two.
        statements: list[dict[int, tuple[int, int]]] = []
        for (pid, epoch), position in furthest.items():
            for entries in statements:
                if pid not in entries:
                    entries[pid] = (position, epoch)
                    break
            else:
                statements.append({pid: (position, epoch)})
        applied: set[tuple[int, int]] = set()
        try:
            async with asyncio.timeout(self._timeout):
                for entries in statements:
                    done = await leases.commit(
                        self._lender,
                        self._group,
                        member_id,
                        [(pid, pos, ep) for pid, (pos, ep) in entries.items()],
                        self._now(),
                    )
                    applied.update((pid, entries[pid][1]) for pid in done)
        except Exception as exc:
            warn_unless_said(self._log, "commit_failed", exc, partitions=len(furthest))
            for c in commits:
                if not c.reply.done():
                    c.reply.set_exception(exc)
            return
        except BaseException:
            for c in commits:
                if not c.reply.done():
                    c.reply.set_exception(ActorStoppedError("the Committer stopped while writing"))
            raise
        for c in commits:
            if not c.reply.done():
                c.reply.set_result((c.partition_id, c.epoch) in applied)
