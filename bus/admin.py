"""Administration: groups (list, describe, reset, delete, sweep), topics (stats), retention (force_complete)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from bus import queue_features
from bus.context import context_of
from bus.types import PartitionStats, Rate, Record, TopicPartition
from storage import db
from storage import groups as group_sql
from storage import queue_controls as queue_sql
from storage import queue_depth as depth_sql
from storage import topics as topic_sql
from storage.errors import GroupHasMembersError, GroupNotFoundError, TopicNotFoundError, ValidationError
from storage.names import MAX_OFFSET, validate_int, validate_name, validate_seconds

if TYPE_CHECKING:
    from bus.context import BusContext, Connected
    from bus.workflows.engine import WorkflowHandle
    from bus.workflows.types import WorkflowInfo


class GroupSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One line of `list_groups`."""

    name: str
    state: str
    status: str
    members: int
    total_lag: int
    generation: int = 0


class MemberInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One member of a group: where it runs, its last heartbeat, whether it is live, what it owns."""

    member_id: str
    instance_id: str | None
    host: str
    pid: int
    last_heartbeat: datetime
    live: bool
    partitions: list[TopicPartition]


class SubscriptionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The group's start as recorded when it first joined."""

    start: str  # earliest | latest | timestamp | offsets
    start_time: datetime | None
    start_offsets: dict[str, dict[str, int]] | None
    recorded_at: datetime


class PartitionLag(msgspec.Struct, frozen=True, kw_only=True):
    """A group's position on one partition: committed offset, log bounds, lag, owner."""

    topic: str
    partition: str
    committed: int | None
    end_offset: int
    log_start: int
    lag: int
    lag_seconds: float | None
    owner: str | None


class GroupDescription(msgspec.Struct, frozen=True, kw_only=True):
    """`describe_group`: everything `bus describe GROUP` shows."""

    name: str
    generation: int
    state: str
    status: str
    leader: str | None
    assignor: str
    members: list[MemberInfo]
    subscription: SubscriptionInfo
    partitions: list[PartitionLag]
    topics: list[str]

    @property
    def total_lag(self) -> int:
        """The group's lag summed over every partition it reads."""
        return sum(p.lag for p in self.partitions)


class ResetRow(msgspec.Struct, frozen=True):
    """One partition of `reset_offsets`: its committed offset now and the one it gets."""

    topic: str
    partition: str
    current: int | None
    new: int


class PartitionDepth(msgspec.Struct, frozen=True, kw_only=True):
    """One partition of a queue topic: jobs waiting (due), running (taken), delayed (not due yet), dead."""

    partition: str
    waiting: int
    running: int
    delayed: int
    dead: int


class QueueDepth(msgspec.Struct, frozen=True, kw_only=True):
    """What a queue topic holds to be done (`admin.queue_depth`): totals, and per partition.

    `waiting`: due jobs no one holds (a job whose lease ran out is waiting again);
    `running`: jobs taken and not yet acked or nacked; `delayed`: jobs not due yet
    (published with a delay, or nacked with one); `dead`: jobs dead-lettered from this
    topic that still wait in `dead_letter` (None: no dead-letter topic). Acked jobs
    are not counted, whatever the log still stores.
    """

    topic: str
    waiting: int
    running: int
    delayed: int
    dead: int
    dead_letter: str | None
    partitions: list[PartitionDepth]


class Admin:
    """`b.admin`: inspection and repair of groups and topics."""

    def __init__(self, ctx: BusContext | Connected) -> None:
        self._ctx = context_of(ctx)

    async def list_groups(self) -> list[GroupSummary]:
        """Every group with its state, status, live members and total lag."""
        with db.translate_errors():
            rows = await group_sql.list_groups(self._ctx.pool)
        return [
            GroupSummary(
                name=r.name,
                state=r.state,
                status=r.status,
                members=r.members,
                total_lag=r.total_lag,
                generation=r.generation,
            )
            for r in rows
        ]

    async def describe_group(self, group: str) -> GroupDescription:
        """Generation, state, leader, members and their partitions, and every partition's committed/end/lag/owner."""
        validate_name(group, "group name")
        pool = self._ctx.pool
        with db.translate_errors():
            g = await group_sql.get_group(pool, group)
            if g is None:
                raise GroupNotFoundError(f"group {group!r} does not exist; list groups with `bus groups`")
            rows = await group_sql.describe_partitions(pool, group)
            members = await group_sql.members(pool, group)
            topics = await group_sql.group_topics(pool, group)
        tp_of = {r.partition_id: TopicPartition(r.topic, r.partition) for r in rows}
        start_offsets = msgspec.json.decode(g["start_offsets"]) if g["start_offsets"] else None
        return GroupDescription(
            name=g["name"],
            generation=g["generation"],
            state=g["state"],
            status=g["status"],
            leader=g["leader"],
            assignor=g["assignor"],
            topics=topics,
            subscription=SubscriptionInfo(
                start=g["start_mode"],
                start_time=g["start_time"],
                start_offsets=start_offsets,
                recorded_at=g["recorded_at"],
            ),
            members=[
                MemberInfo(
                    member_id=m.member_id,
                    instance_id=m.instance_id,
                    host=m.host,
                    pid=m.pid,
                    last_heartbeat=m.last_heartbeat,
                    live=m.live,
                    partitions=sorted(tp_of[p] for p in m.assignment if p in tp_of),
                )
                for m in members
            ],
            partitions=[
                PartitionLag(
                    topic=r.topic,
                    partition=r.partition,
                    committed=r.committed,
                    end_offset=r.next_offset,
                    log_start=r.log_start,
                    lag=int(r.lag),
                    lag_seconds=None if r.lag_seconds is None or r.lag == 0 else float(r.lag_seconds),
                    owner=r.owner if r.lease_live else None,
                )
                for r in rows
            ],
        )

    async def reset_offsets(
        self,
        group: str,
        to: str | datetime | int = "earliest",
        topic: str | None = None,
        *,
        dry_run: bool = False,
    ) -> list[ResetRow]:
        """Move the group's committed offsets to `to` ("earliest" | "latest" | datetime | int).

        Refused (GroupHasMembersError) while the group has live members. The only
        operation that may move a committed offset backwards.
        """
        validate_name(group, "group name")
        if topic is not None:
            validate_name(topic, "topic name")
        mode, at, offset = _reset_target(to)
        with db.translate_errors():
            async with self._ctx.pool.acquire() as conn, conn.transaction():
                if not await group_sql.lock_group(conn, group):
                    raise GroupNotFoundError(f"group {group!r} does not exist")
                live = await group_sql.live_member_count(conn, group)
                if live:
                    raise GroupHasMembersError(
                        f"group {group!r} has {live} live member(s); stop them (or wait for their session to expire) "
                        "before resetting offsets"
                    )
                plan = await group_sql.reset_plan(conn, group, mode, at, offset, topic)
                if topic is not None and not plan:
                    raise TopicNotFoundError(f"group {group!r} does not read topic {topic!r}")
                if not dry_run:
                    await group_sql.apply_reset(conn, group, [(r.partition_id, r.new) for r in plan])
        return [ResetRow(r.topic, r.partition, r.current, r.new) for r in plan]

    async def delete_group(self, group: str) -> None:
        """Delete the group, its members and cursors (refused while members are live)."""
        validate_name(group, "group name")
        with db.translate_errors():
            async with self._ctx.pool.acquire() as conn, conn.transaction():
                if not await group_sql.lock_group(conn, group):
                    raise GroupNotFoundError(f"group {group!r} does not exist")
                live = await group_sql.live_member_count(conn, group)
                if live:
                    raise GroupHasMembersError(f"group {group!r} has {live} live member(s); stop them first")
                await group_sql.delete_group(conn, group)

    async def sweep(self) -> int:
        """Run dead-member and dead-group detection now; returns the number of members removed."""
        system = await self._ctx.group_system()
        return int(await system.sweep())

    async def force_complete(self, topic: str, older_than: timedelta | float) -> int:
        """Remove messages of `topic` older than `older_than` that only dead or cancelled groups still hold back."""
        validate_name(topic, "topic name")
        await self._ctx.topic(topic)
        seconds = validate_seconds(older_than, "older_than", allow_zero=True)
        from storage import retention

        with db.translate_errors():
            async with self._ctx.pool.acquire() as conn:
                return int(await retention.force_complete(conn, topic, seconds))

    async def update_topic(
        self,
        name: str,
        *,
        max_in_flight_per_key: Any = queue_features.UNSET,
        rate_limit: Any = queue_features.UNSET,
        result_ttl: Any = queue_features.UNSET,
    ) -> None:
        """Change a queue topic's limits (None removes one; an argument not given is kept) or result_ttl.

        Every consumer in every process applies them from its next take.
        """
        current = await self.queue_settings(name)
        per_key = current[0] if max_in_flight_per_key is queue_features.UNSET else max_in_flight_per_key
        rate = current[1] if rate_limit is queue_features.UNSET else rate_limit
        limited = queue_features.limits(per_key, rate)
        ttl = None if result_ttl is queue_features.UNSET else queue_features.result_ttl(result_ttl)
        await queue_features.apply(self._ctx, name, limited=limited, ttl=ttl)

    async def queue_settings(self, name: str) -> tuple[int | None, Rate | None, bool, timedelta]:
        """A queue topic's (max_in_flight_per_key, rate_limit, paused, result_ttl)."""
        validate_name(name, "topic name")
        with db.translate_errors():
            row = await queue_sql.get(self._ctx.pool, name)
        if row is None:
            await self._ctx.topic(name)  # TopicNotFoundError for an unknown topic
            return None, None, False, timedelta(days=1)
        rate = None if row["rate_limit"] is None else Rate(row["rate_limit"], per=row["rate_per"])
        return row["max_in_flight_per_key"], rate, row["paused"], timedelta(seconds=row["result_ttl"])

    async def pause_queue(self, topic: str) -> None:
        """Stop every consumer of the queue in every process from taking jobs (taken ones still ack)."""
        await queue_features.apply(self._ctx, validate_name(topic, "topic name"), paused=True)

    async def resume_queue(self, topic: str) -> None:
        """Let the queue's consumers take jobs again (the waiting ones are woken)."""
        await queue_features.apply(self._ctx, validate_name(topic, "topic name"), paused=False)

    async def cancel_job(self, topic: str, rec: Record) -> bool:
        """Cancel a queue job: False if it is no longer there (acked, dead-lettered, cancelled before).

        A job not yet taken is never handed out; a taken one is not retried after its nack or expiry
        (its ack still works). `b.job_result` raises JobFailedError for it.
        """
        return await queue_features.cancel_job(self._ctx, topic, rec)

    async def queue_depth(self, topic: str, dead_letter: str | None = None) -> QueueDepth:
        """A queue topic's jobs to be done: waiting, running, delayed and dead, in all and per partition.

        `dead` counts the jobs dead-lettered from `topic` still waiting in `dead_letter`
        (default `<topic>.dlq`, when that topic exists). ValidationError for a pubsub topic.
        """
        return await _queue_depth(self._ctx, topic, dead_letter)

    async def topic_stats(self, topic: str) -> list[PartitionStats]:
        """Per partition: log start, end offset, stored messages, oldest and newest timestamps."""
        await self._ctx.topic(topic)
        with db.translate_errors():
            rows = await topic_sql.topic_stats(self._ctx.pool, topic)
        return [
            PartitionStats(
                partition=r["partition"],
                log_start=r["log_start"],
                end_offset=r["end_offset"],
                size=r["size"],
                oldest=r["oldest"],
                newest=r["newest"],
            )
            for r in rows
        ]

    # -- durable workflows (bus.workflows) ---------------------------------------------

    async def workflows(
        self, status: str | None = None, name: str | None = None, limit: int = 100
    ) -> list[WorkflowInfo]:
        """Workflow runs, newest first, with their recorded steps (attempts, errors)."""
        from bus.workflows.engine import engine_of

        return await engine_of(self._ctx).list(status, name, limit)

    async def workflow(self, workflow_id: str) -> WorkflowInfo:
        """One run with its recorded steps; WorkflowNotFoundError if no run has that id."""
        from bus.workflows.engine import engine_of

        return await engine_of(self._ctx).info(workflow_id)

    async def cancel_workflow(self, workflow_id: str) -> bool:
        """Cancel the run and its unfinished children (their executors stop at their next step)."""
        from bus.workflows.engine import engine_of

        return await engine_of(self._ctx).cancel(workflow_id)

    async def resume_workflow(self, workflow_id: str) -> bool:
        """A cancelled or failed run goes on from its last successful step; False if it was neither."""
        from bus.workflows.engine import engine_of

        return await engine_of(self._ctx).resume(workflow_id)

    async def fork_workflow(
        self, workflow_id: str, from_step: int = 1, *, new_id: str | None = None
    ) -> WorkflowHandle:
        """A new run of the same workflow and input that keeps the recorded steps before `from_step`
        (numbered from 1) and runs the rest again."""
        from bus.workflows.engine import engine_of

        return await engine_of(self._ctx).fork(workflow_id, from_step, new_id)


async def _queue_depth(ctx: BusContext, topic: str, dead_letter: str | None) -> QueueDepth:
    info = await ctx.topic(topic)
    if info.semantics != "queue":
        raise ValidationError(
            f"topic {topic!r} is a {info.semantics} topic: queue_depth counts the jobs of a queue topic; "
            "for a group's backlog use describe_group(...).partitions (lag)"
        )
    explicit = dead_letter is not None
    dlq = validate_name(dead_letter, "dead_letter topic") if explicit else f"{topic}.dlq"
    with db.translate_errors():
        counts = await depth_sql.depth(ctx.pool, topic)
        try:
            await ctx.topic(dlq)
        except TopicNotFoundError:
            if explicit:
                raise
            dead: dict[str, int] | None = None
        else:
            dead = await depth_sql.dead_by_source(ctx.pool, topic, dlq)
    partitions = [
        PartitionDepth(
            partition=c.partition,
            waiting=c.waiting,
            running=c.running,
            delayed=c.delayed,
            dead=(dead or {}).get(c.partition, 0),
        )
        for c in counts
    ]
    return QueueDepth(
        topic=topic,
        waiting=sum(p.waiting for p in partitions),
        running=sum(p.running for p in partitions),
        delayed=sum(p.delayed for p in partitions),
        dead=sum((dead or {}).values()),
        dead_letter=dlq if dead is not None else None,
        partitions=partitions,
    )


def _reset_target(to: object) -> tuple[str, datetime | None, int | None]:
    if to in ("earliest", "latest"):
        return str(to), None, None
    if isinstance(to, datetime):
        return "timestamp", (to if to.tzinfo else to.astimezone()), None
    if isinstance(to, int) and not isinstance(to, bool):
        return "offset", None, validate_int(to, "a reset offset", 0, MAX_OFFSET)
    raise ValidationError(
        f"reset target {to!r} not understood: use 'earliest', 'latest', a datetime or an offset"
    )


def parse_reset_target(text: str) -> str | datetime | int:
    """The CLI's --to: earliest | latest | an integer offset | an ISO datetime."""
    if text in ("earliest", "latest"):
        return text
    if text.isdigit():
        return int(text)
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise ValidationError(f"--to {text!r}: use earliest, latest, an offset, or an ISO datetime") from None
