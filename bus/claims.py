"""Claims: lease-based consumption of many (or dynamic) partitions, Queen's pop.

    claim = await b.claim("billing", topic="orders", worker_id="w-1")
    if claim is not None:
        for m in claim.messages: ...
        await claim.ack()

A claim leases the free partition whose first pending message is the oldest,
returns up to `max_messages` of it, and holds the lease for `lease_time`
seconds. `ack()` advances the group's cursor and releases; an expired lease
lets another worker take the partition (and the same messages) again.

Fencing: every lease bumps the cursor's `lease_epoch`; `ack`, `extend` and
`release` apply only if owner and epoch still match, in the statement that
applies them. So a worker whose lease expired and was taken by someone else
gets `LeaseLostError` and changes nothing, on that call and on every later
`ack`, `extend` or `release` of the same claim. A lease that expired but that
nobody took yet still matches: that late ack succeeds (no one else has seen
those messages as ours, so nothing is delivered twice by accepting it).

The group's subscription start (`start=`, else the Bus's `default_start`) is
recorded by the first claim of the group and applies to every partition it
discovers later, including partitions and labelled topics created afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from actors import metrics as _metrics
from bus import tracing
from bus.codec import messages_from_rows
from bus.start import StartInput, StartSpec, parse_start
from bus.types import Message
from storage import claims as sql
from storage import db
from storage import groups as groups_sql
from storage.db import Conn, Connection
from storage.errors import GroupStoppedError, LeaseLostError, TopicNotFoundError, ValidationError
from storage.logs import get_logger
from storage.names import validate_int, validate_name, validate_offset, validate_seconds, validate_worker_id

if TYPE_CHECKING:
    from bus.context import BusContext

__all__ = ["Claim", "claim"]

log = get_logger(__name__)

#: How often (seconds) a Bus re-checks a group's topics, status and every
#: partition for missing cursors. In between, only partitions with ids above
#: the last seen one are looked at (one index probe per claim).
FULL_SYNC_INTERVAL = 1.0

# Candidates found caught up (pending_since stale) are fixed and skipped; this
# bounds one call's work when many are stale at once.
_MAX_STALE_SKIPS = 64


@dataclass
class _Discovery:
    topics: list[str]
    mark: int
    synced_at: float


@dataclass
class _BusState:
    discovery: dict[tuple[str, str | None, str | None, str | None], _Discovery] = field(default_factory=dict)


class Claim:
    """A leased partition: `messages` to process, then `ack()` (or `release()`).

    `topic`, `partition`, `messages` (list of bus.Message) and
    `lease_expires_at` (server time) are the public fields.
    """

    def __init__(
        self,
        ctx: BusContext,
        group: str,
        worker_id: str,
        partition_id: int,
        epoch: int,
        topic: str,
        partition: str,
        messages: list[Message],
        lease_expires_at: datetime,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.messages = messages
        self.lease_expires_at = lease_expires_at
        self.group = group
        self.worker_id = worker_id
        self._ctx = ctx
        self._partition_id = partition_id
        self._epoch = epoch
        self._finished = False  # acked or released by this object
        self._lost_to: str | None = None  # who held the partition when the lease was found lost
        self._log = log.bind(group=group, topic=topic, partition=partition, worker=worker_id, epoch=epoch)

    def __repr__(self) -> str:
        span = f"{self.messages[0].offset}..{self.messages[-1].offset}" if self.messages else "-"
        return f"<Claim {self.group} {self.topic}/{self.partition} offsets {span} epoch {self._epoch}>"

    @property
    def lease_epoch(self) -> int:
        """The fencing epoch of this lease."""
        return self._epoch

    async def ack(self, offset: int | None = None) -> None:
        """Advance the group's cursor past `offset` (default: the last message) and release the lease.

        Raises LeaseLostError, applying nothing, if the lease expired and
        another worker took the partition, and again on every later call.
        Acking a claim this object already acked or released is a no-op.
        """
        self._raise_if_lost("ack")
        if self._finished:
            return
        first, last = self.messages[0].offset, self.messages[-1].offset
        if offset is None:
            offset = last
        validate_offset(offset, "ack offset")
        if not first <= offset <= last:
            raise ValidationError(
                f"ack offset {offset} is outside this claim's messages ({first}..{last}); "
                "ack one of the claimed offsets, or ack() for all of them"
            )
        with db.translate_errors():
            async with self._ctx.lender.lend() as conn:
                done = await sql.ack(
                    conn, self.group, self._partition_id, self.worker_id, self._epoch, offset + 1
                )
                if done is None:
                    await self._lost(conn, "ack")
        self._finished = True
        _metrics.claim_acked(self.group, self.topic)
        self._log.debug("claim_acked", committed=offset + 1)

    async def release(self) -> bool:
        """Give the partition back without advancing (the same messages come back); returns True.

        Raises LeaseLostError if the lease expired and another worker took the
        partition (there is nothing left to release), and again on every later
        call. Releasing a claim this object already acked or released is a no-op.
        """
        self._raise_if_lost("release")
        if self._finished:
            return True
        with db.translate_errors():
            async with self._ctx.lender.lend() as conn:
                released = await sql.release(
                    conn, self.group, self._partition_id, self.worker_id, self._epoch
                )
                if not released:
                    await self._lost(conn, "release")
        self._finished = True
        return True

    async def extend(self, seconds: float | timedelta) -> None:
        """Keep the lease `seconds` more from now; LeaseLostError if someone else took it meanwhile."""
        seconds = validate_seconds(seconds, "extend seconds")
        self._raise_if_lost("extend")
        if self._finished:
            raise LeaseLostError(
                f"claim on {self.topic}/{self.partition} for group {self.group!r} was already acked or released; "
                "claim again"
            )
        with db.translate_errors():
            async with self._ctx.lender.lend() as conn:
                expires = await sql.extend(
                    conn,
                    sql.ExtendParams(
                        group=self.group,
                        partition_id=self._partition_id,
                        worker=self.worker_id,
                        epoch=self._epoch,
                        seconds=seconds,
                        now=self._ctx.now(),
                    ),
                )
                if expires is None:
                    await self._lost(conn, "extend")
        self.lease_expires_at = expires  # type: ignore[assignment]

    def _raise_if_lost(self, what: str) -> None:
        # A lost lease stays lost: its epoch is behind for good, so every later
        # ack/extend/release is refused without asking the database again.
        if self._lost_to is not None:
            raise self._lease_lost_error(what, self._lost_to)

    async def _lost(self, conn: Conn, what: str) -> None:
        state = await sql.lease_state(conn, self.group, self._partition_id)
        holder = "nobody" if state is None or state.owner is None else repr(state.owner)
        self._lost_to = holder
        self._log.warning("claim_lease_lost", action=what, holder=holder)
        _metrics.lease_lost(self.group, self.topic)
        raise self._lease_lost_error(what, holder)

    def _lease_lost_error(self, what: str, holder: str) -> LeaseLostError:
        return LeaseLostError(
            f"{what} refused: the lease of group {self.group!r} on {self.topic}/{self.partition} expired and "
            f"was taken again (held by {holder} when the loss was found); nothing was applied. Claim again, "
            "and use a longer lease_time or extend() for slow work"
        )


async def claim(
    ctx: BusContext,
    group: str,
    topic: str | None = None,
    *,
    namespace: str | None = None,
    task: str | None = None,
    worker_id: str,
    max_messages: int = 100,
    lease_time: float | timedelta | None = None,
    start: StartInput = None,
) -> Claim | None:
    """Lease the free partition with the earliest pending message of `topic` (or of the
    topics labelled `namespace`/`task`, including ones created later) for `group`.

    Returns None when nothing is pending. The group's start is recorded by
    its first claim (`start`, else the Bus's `default_start`) and never changes.
    """
    validate_name(group, "group name")
    validate_worker_id(worker_id)
    if topic is None and namespace is None and task is None:
        raise ValidationError("claim needs a topic, or a namespace and/or task to match topics by label")
    if topic is not None and (namespace is not None or task is not None):
        raise ValidationError("claim takes either a topic or namespace/task labels, not both")
    if namespace is not None:
        validate_name(namespace, "namespace")
    if task is not None:
        validate_name(task, "task")
    validate_int(max_messages, "max_messages", 1, 100_000)
    seconds = ctx.config.lease_time if lease_time is None else validate_seconds(lease_time, "lease_time")
    spec = parse_start(start, ctx.config.default_start)
    if topic is not None:
        await ctx.topic(topic)  # TopicNotFoundError before anything is written

    with db.translate_errors():
        async with ctx.lender.lend() as conn:  # generic plans: see storage.db.GENERIC_PLANS
            topics = await _discover(ctx, conn, group, topic, namespace, task, spec)
            if not topics:
                return None
            for _ in range(_MAX_STALE_SKIPS):
                async with conn.transaction():
                    cand = await sql.pick_candidate(conn, group, topics, ctx.now())
                    if cand is None:
                        return None
                    pid = cand.partition_id
                    log_start = cand.log_start
                    rows = await sql.read_from(conn, pid, max(cand.committed, log_start), max_messages)
                    if not rows:
                        # pending_since was stale (e.g. another reader advanced the cursor).
                        await sql.refresh_pending(conn, group, pid)
                        continue
                    lease = await sql.take_lease(
                        conn,
                        sql.TakeLeaseParams(
                            group=group,
                            partition_id=pid,
                            worker=worker_id,
                            seconds=seconds,
                            log_start=log_start,
                            now=ctx.now(),
                        ),
                    )
                await sql.touch_group(conn, group)
                messages = messages_from_rows(cand.topic, cand.partition, rows)
                _metrics.claimed(group, cand.topic, len(messages))
                tracing.received("claim", messages, group=group)
                log.debug(
                    "claimed",
                    group=group,
                    topic=cand.topic,
                    partition=cand.partition,
                    worker=worker_id,
                    epoch=lease.lease_epoch,
                    count=len(messages),
                )
                return Claim(
                    ctx,
                    group,
                    worker_id,
                    pid,
                    lease.lease_epoch,
                    cand.topic,
                    cand.partition,
                    messages,
                    lease.lease_expires_at,
                )
    return None


async def _discover(
    ctx: BusContext,
    conn: Connection,
    group: str,
    topic: str | None,
    namespace: str | None,
    task: str | None,
    spec: StartSpec,
) -> list[str]:
    """Make sure the group exists and has a cursor on every targeted partition; the targeted topics.

    The full check (group row, topics, every partition) runs at most every
    FULL_SYNC_INTERVAL per Bus; in between only partitions newer than the
    last seen id are materialized, so a claim stays O(1) in the partition count.
    """
    state = ctx.state(_BusState)
    key = (group, topic, namespace, task)
    found = state.discovery.get(key)
    now = time.monotonic()
    if found is None or now - found.synced_at >= FULL_SYNC_INTERVAL:
        mark = await sql.max_partition_id(conn)
        async with conn.transaction():
            created = await groups_sql.record_group(
                conn,
                groups_sql.RecordGroupParams(
                    name=group,
                    start_mode=spec.start_mode,
                    start_time=spec.start_time,
                    start_offsets_json=spec.start_offsets_json,
                    lookback_seconds=ctx.config.lookback,
                    namespace=namespace,
                    task=task,
                ),
            )
            status = await sql.group_status(conn, group)
            if status == "stopped":
                raise GroupStoppedError(f"group {group!r} is stopped; start it again before claiming")
            topics = [topic] if topic is not None else await sql.labelled_topics(conn, namespace, task)
            if topics:
                await groups_sql.add_group_topics(conn, group, topics)
        if created:
            log.info("group_recorded", group=group, start=spec.describe())
        if topic is not None and not topics:
            raise TopicNotFoundError(f"topic {topic!r} does not exist")
        await _materialize(conn, group, await sql.untracked_partitions(conn, group, topics, 0))
        state.discovery[key] = _Discovery(topics, mark, now)
        return topics
    latest = await sql.max_partition_id(conn)
    if latest != found.mark:
        await _materialize(conn, group, await sql.untracked_partitions(conn, group, found.topics, found.mark))
        found.mark = latest
    return found.topics


async def _materialize(conn: Connection, group: str, partition_ids: list[int]) -> None:
    if not partition_ids:
        return
    async with conn.transaction():
        await sql.mark_claimed(conn, partition_ids)
        await groups_sql.materialize_offsets(conn, group, partition_ids)
        await sql.mark_new_cursors_pending(conn, group, partition_ids)
