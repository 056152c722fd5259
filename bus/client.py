"""`connect()` and the Bus: the object a service holds."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import asyncpg
import msgspec

from actors import metrics as _metrics
from actors.producer import Producer, ProducerSettings, ProducerStats
from bus import queue_features, tracing
from bus.codec import to_message
from bus.config import Config
from bus.context import BusContext
from bus.publishing import Publisher, topic_info
from bus.publishing import key_partition as key_partition  # re-exported: the partition a key maps to
from bus.types import Health, JobGroup, JobStatus, Message, Outgoing, Rate, Record, TopicInfo, Unique
from storage import db
from storage import messages as log_sql
from storage import topics as topic_sql
from storage.errors import (
    OffsetOutOfRangeError,
    TopicConflictError,
    TopicNotFoundError,
    ValidationError,
)
from storage.logs import get_logger
from storage.names import validate_int, validate_name, validate_offset, validate_partition, validate_seconds

if TYPE_CHECKING:
    from types import ModuleType

    from actors.system import GroupSystem
    from bus.admin import Admin
    from bus.claims import Claim
    from bus.consumer import Consumer, Retry, Subscription
    from bus.eventstore import EventStore
    from bus.handoff import Callback
    from bus.queues import QueueConsumer
    from bus.schedules import ScheduleInfo
    from bus.worker import JobHandler, Worker
    from bus.workflows.engine import WorkflowHandle

log = get_logger(__name__)

# How long `Bus.close` waits for its actors to stop and for each pool's connections to come back;
# past it the connections are closed at once (a statement a caller still runs gets an error).
CLOSE_TIMEOUT = 30.0


async def _bounded(step: Awaitable[object], event: str) -> bool:
    """Await `step` for at most CLOSE_TIMEOUT; False (and `event` logged) when it ran out."""
    try:
        await asyncio.wait_for(step, CLOSE_TIMEOUT)
    except TimeoutError:
        log.warning(event, seconds=CLOSE_TIMEOUT)
        return False
    return True


async def _close_pool(pool: asyncpg.Pool) -> None:
    """Close `pool` gracefully, or terminate it when a connection is not given back in CLOSE_TIMEOUT."""
    if not await _bounded(pool.close(), "close_pool_timed_out"):
        pool.terminate()


T = TypeVar("T")

_SEMANTICS = ("pubsub", "queue")
_DEDUPE_WINDOW = timedelta(hours=24)
_CLEANUP = ("delete", "compact")


class Bus:
    """A connection to the bus: topics, publishing, reading, and the consumers built on them.

    Attributes beside the methods: `dsn`, the DSN in use (the embedded server's too, with its
    password: hand it to tools, do not log it); `config`, the settings (`bus.Config`); `pool`,
    the bus's own asyncpg pool, whose connections have `search_path` set to the bus schema
    (`config.schema`): an unqualified name there is a bus table, so use it for the bus's views
    and functions, not for the service's tables. For the service's own tables use
    `async with b.connection() as conn:` (PostgreSQL's default search_path, `"$user", public`:
    an unqualified `CREATE TABLE` or `SELECT ... FROM payments` means the service's table), or a
    transactional handler's `tx.connection`, which sees the same.
    """

    def __init__(self, dsn: str, config: Config, pool: asyncpg.Pool, embedded: Any = None) -> None:
        self.dsn = dsn
        self.config = config
        self.pool = pool
        # The bus's own hot-path statements (fetch, commit, queue takes and acks) run on a few pool
        # connections kept out between uses: asyncpg's acquire and release cost a round trip's worth.
        # At most half of the pool (none of a pool of 1: the Bus's other statements need one).
        self.lender = db.Lender(
            pool, min(8, config.pool_max_size // 2), generic_plans=config.pooler != "transaction"
        )
        self.embedded = embedded
        # What the sub-facades (consumers, queues, claims, the event store, admin, metrics) take.
        self.context = BusContext(
            dsn=dsn,
            config=config,
            pool=pool,
            lender=self.lender,
            # the publisher, built from this context below, caches topic lookups
            topic=lambda name: self.publisher.shared_topic(name),
            create_topic=self.create_topic,
            publish_many=self.publish_many,
            group_system=self._group_system,
            resolve=lambda name: self.publisher.resolve(name),
        )
        self.channels = self.context.channels
        # The publish pipeline: topic and partition lookups (cached), preparation and the write.
        self.publisher = Publisher(self.context)
        self._closed = False
        self._cleaner: Any = None  # the retention cleaner actor (actors/cleaner.py)
        self._scheduler: Any = None  # the periodic jobs' scheduler actor (actors/scheduler.py)
        self._producer: Any = None  # the Producer actor (actors/producer.py): pool publishes go through it
        self._service_pool: asyncio.Future[asyncpg.Pool] | None = None

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection to the bus's database for the service's own tables (`async with`).

        It has PostgreSQL's default search_path (`"$user", public`), not the bus schema: an
        unqualified `CREATE TABLE payments` or `SELECT ... FROM payments` means the service's
        table. Publish inside its transaction with `b.publish(..., connection=conn)` (outbox).
        Connections come from a pool of their own (up to `pool_max_size`, opened on first use).
        """
        if self._service_pool is None:
            self._service_pool = asyncio.ensure_future(
                db.create_service_pool(
                    self.dsn, max_size=self.config.pool_max_size, pooler=cast("db.Pooler", self.config.pooler)
                )
            )
        try:
            pool = await asyncio.shield(self._service_pool)
        except BaseException:
            if self._service_pool.done():
                self._service_pool = None  # a failed open is tried again next time
            raise
        with db.translate_errors():
            async with pool.acquire() as conn:
                yield cast("asyncpg.Connection", conn)

    # -- lifecycle -----------------------------------------------------------------

    async def close(self) -> None:
        """Stop every actor gracefully (members leave, offsets commit, leases release), then the pool."""
        if self._closed:
            return
        self._closed = True
        if "bus.workflows.engine" in sys.modules:  # workflows load with their first use
            # runs left here when it runs out are taken over as their leases lapse
            await _bounded(
                sys.modules["bus.workflows.engine"].close_engine(self.context), "close_workflows_timed_out"
            )
        if self._cleaner is not None:
            await self._cleaner.stop(drain=False)
        if self._scheduler is not None:
            await self._scheduler.stop(drain=False)
        if self.context.system is not None:
            # an actor still waiting on the database when it runs out holds soft state only
            await _bounded(self.context.system.stop(), "close_actors_timed_out")
        await self.lender.close()
        if self._service_pool is not None:
            if self._service_pool.done() and not self._service_pool.exception():
                await _close_pool(self._service_pool.result())
            else:
                self._service_pool.cancel()
        await _close_pool(self.pool)

    def health(self) -> Health:
        """Whether this Bus can do its work now ("healthy"), is waiting out a database outage
        ("degraded": it comes back by itself), or needs reopening ("failed"); see `bus.Health`.

        Reads what the Bus already knows (no statement is run): the Notifier and the
        HeartbeatMonitor notice an outage within about a second, and its end as soon as a
        connection opens again.
        """
        system = self.context.system
        problems: list[str] = []
        available = True
        since = None
        lasted = None
        outages, last = 0, None
        failed: list[str] = []
        if system is not None:
            seen = system.availability
            available, since, lasted = seen.available, seen.unavailable_since, seen.unavailable_for
            outages, last = seen.outages, seen.last_outage
            if not available:
                problems.append(
                    f"the database cannot be reached ({seen.error}); the bus retries until it is back "
                    "(publishes raise StorageUnavailableError meanwhile, consumers wait)"
                )
            failed = sorted({name for name, _ in system.errors})
            if failed:
                problems.append(
                    f"system actor(s) {', '.join(failed)} stopped for good after repeated failures "
                    "(the log says why: system_actor_failed); close this Bus and connect again"
                )
        if self._closed:
            problems.append("the Bus is closed; connect again")
        status = "failed" if failed or self._closed else "healthy" if available else "degraded"
        return Health(
            status=status,
            database_available=available,
            unavailable_since=since,
            unavailable_seconds=lasted,
            outages=outages,
            last_outage_seconds=last,
            failed_actors=failed,
            problems=problems,
        )

    async def _start(self) -> None:
        """Start the per-Bus system actors: the Notifier, the HeartbeatMonitor and the retention cleaner."""
        _metrics.prepare()  # off the event loop, before a first assignment would pay for it
        system = await self._group_system()
        self._start_producer(system)
        if self.config.cleaner_interval > 0:  # 0 (or less) disables this process's cleaner
            from actors.cleaner import start_cleaner

            self._cleaner = start_cleaner(self, system.root)
        if self.config.scheduler_interval > 0:  # 0 (or less): this process fires no periodic jobs
            from actors.scheduler import start_scheduler

            self._scheduler = start_scheduler(self, system.root)

    def _start_producer(self, system: Any) -> None:
        """Spawn the Producer under the Bus's root supervisor (before any member: members stop first)."""
        c = self.config
        settings = ProducerSettings(
            max_batch=c.max_batch,
            max_batch_bytes=c.max_batch_bytes,
            linger=c.linger,
            max_pending=4 * c.max_batch,
        )
        self.producer_stats = stats = ProducerStats()
        dsn, schema, announce, channel = self.dsn, c.schema, system.announce, self.channels.messages
        pooler = cast("db.Pooler", c.pooler)
        # Directly, its connections plan the statements that move the heads themselves (see
        # storage/messages.py, APPEND_PLANNED); a pooler takes no session settings.
        planned = log_sql.PLANNED_SETTINGS if pooler is None else None
        self._producer = system.root.spawn(
            lambda: Producer(
                lambda: db.connect(dsn, schema, pooler=pooler, settings=planned),
                announce,
                settings,
                stats,
                channel,
                now=lambda: self.context.now(),  # a test's Clock moves the idempotency windows
                planned=planned is not None,
            ),
            "producer",
        )
        self.publisher.attach_producer(self._producer)

    async def _group_system(self) -> GroupSystem:
        if self.context.system is not None:
            return self.context.system
        # The actor system loads with the first Bus, not with `import bus`.
        from actors.heartbeat import MonitorConfig
        from actors.system import GroupSystem

        c = self.config
        pooler = cast("db.Pooler", c.pooler)
        # LISTEN needs a session: through a transaction pooler it goes to direct_dsn, or nowhere (polling).
        listen = (
            (lambda: db.connect(c.direct_dsn or self.dsn, c.schema, pooler=None if c.direct_dsn else pooler))
            if c.listens
            else None
        )
        system = GroupSystem(
            self.pool,
            self.lender,
            listen,
            lambda: db.connect(self.dsn, c.schema, pooler=pooler),
            MonitorConfig(
                heartbeat_interval=c.heartbeat_interval,
                lease_time=c.lease_time,
                rebalance_delay=c.rebalance_delay,
                group_heartbeat_timeout=c.group_heartbeat_timeout,
                max_poll_interval=c.max_poll_interval,
                groups_channel=self.channels.groups,
                topics_channel=self.channels.topics,
                now=lambda: self.context.now(),  # a test's Clock moves it (bus.testing)
            ),
            self.channels.messages,
            clock=self.context.time,
        )
        schema = c.schema
        system.availability.on_change = lambda up, ended: _metrics.database_available(schema, up, ended)
        _metrics.database_available(schema, True)
        await system.start()
        self.context.system = system
        return system

    # -- consumer groups -------------------------------------------------------------

    def consumer(
        self,
        group: str,
        *,
        topics: list[str] | None = None,
        namespace: str | None = None,
        task: str | None = None,
        start: Any = None,
        auto_commit: bool = True,
        max_poll_records: int = 500,
        assignor: str = "range",
        instance_id: str | None = None,
        on_assign: Callback | None = None,
        on_revoke: Callback | None = None,
        buffer_size: int | None = None,
    ) -> Consumer:
        """A poll-style consumer group member (see bus.consumer.Consumer); use `async with`.

        `start`: "earliest" | "latest" | a datetime | {(topic, partition): offset}.
        """
        from bus.consumer import Consumer

        return Consumer(
            self.context,
            group,
            topics=topics,
            namespace=namespace,
            task=task,
            start=start,
            auto_commit=auto_commit,
            max_poll_records=max_poll_records,
            assignor=assignor,
            instance_id=instance_id,
            on_assign=on_assign,
            on_revoke=on_revoke,
            buffer_size=buffer_size,
        )

    async def subscribe(
        self,
        group: str,
        handler: Callable[[Message], Awaitable[Any]],
        *,
        topics: list[str] | None = None,
        namespace: str | None = None,
        task: str | None = None,
        start: Any = None,
        retry: Retry | None = None,
        dead_letter: str | None = None,
        assignor: str = "range",
        instance_id: str | None = None,
        batch_size: int = 100,
        on_assign: Callback | None = None,
        on_revoke: Callback | None = None,
        transactional: bool = False,
    ) -> Subscription:
        """Start a handler-style group member (see bus.consumer.Subscription); `await sub.stop()` ends it.

        `transactional=True`: `handler(message, tx)` writes on `tx.connection`, and those writes, what
        it publishes there and the message's offset commit together (effectively-once), with `retry`
        and `dead_letter` as for any handler: a failing message rolls back alone.
        """
        from bus.consumer import Subscription

        sub = Subscription(
            self.context,
            group,
            handler,
            topics=topics,
            namespace=namespace,
            task=task,
            start=start,
            retry=retry,
            dead_letter=dead_letter,
            assignor=assignor,
            instance_id=instance_id,
            batch_size=batch_size,
            on_assign=on_assign,
            on_revoke=on_revoke,
            transactional=transactional,
        )
        return await sub.start()

    @property
    def metrics(self) -> ModuleType:
        """The bus's Prometheus metrics (the `bus.metrics` module: registry, generate_latest, update_lag)."""
        import bus.metrics

        return bus.metrics

    @property
    def admin(self) -> Admin:
        """Group and topic administration (see bus.admin.Admin)."""
        from bus.admin import Admin

        return Admin(self.context)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- topics --------------------------------------------------------------------

    async def create_topic(
        self,
        name: str,
        partitions: int | None = 1,
        *,
        semantics: str = "pubsub",
        cleanup: str = "delete",
        retention: timedelta | float | None = None,
        tombstone_retention: timedelta | float | None = None,
        namespace: str | None = None,
        task: str | None = None,
        max_message_bytes: int | None = None,
        dedupe_window: timedelta | float | None = _DEDUPE_WINDOW,
        max_in_flight_per_key: int | None = None,
        rate_limit: Rate | None = None,
        result_ttl: timedelta | float | None = None,
        fair: bool = False,
    ) -> TopicInfo:
        """Create a topic; an identical one already there is a no-op, a different one raises TopicConflictError.

        `retention` 0 removes a message as soon as every live group reading its partition has committed
        past it; `dedupe_window` is how long a publish's `idempotency_key` is remembered (None: for ever).
        `fair=True` (queue topics): takes rotate across keys, so one key's backlog cannot starve the
        others (consumers opened after it was set take fairly; see docs/queues.md).
        """
        validate_name(name, "topic name")
        if partitions is not None:
            try:
                validate_int(partitions, "partitions", 1, 100_000)
            except ValidationError as exc:
                raise ValidationError(f"{exc}; or None for dynamic named partitions") from None
        if semantics not in _SEMANTICS:
            raise ValidationError(f"semantics must be one of {_SEMANTICS}, not {semantics!r}")
        if cleanup not in _CLEANUP:
            raise ValidationError(f"cleanup must be one of {_CLEANUP}, not {cleanup!r}")
        if namespace is not None:
            validate_name(namespace, "namespace")
        if task is not None:
            validate_name(task, "task")
        limit = self.config.max_message_bytes if max_message_bytes is None else max_message_bytes
        validate_int(limit, "max_message_bytes (a positive size up to 1 GiB, PostgreSQL's limit)", 1, 1 << 30)
        # Each duration converted once; None keeps messages (or keys) for ever.
        retention_s = validate_seconds(
            retention, "retention (None: keep for ever)", allow_zero=True, allow_none=True
        )
        tombstone_s = validate_seconds(
            tombstone_retention, "tombstone_retention (None: keep)", allow_none=True
        )
        dedupe_s = validate_seconds(dedupe_window, "dedupe_window (None: for ever)", allow_none=True)
        # Queue settings (bus.queue_features): set on the queue after it is created.
        limited = queue_features.limits(max_in_flight_per_key, rate_limit)
        ttl = None if result_ttl is None else queue_features.result_ttl(result_ttl)
        if not isinstance(fair, bool):
            raise ValidationError("fair must be True or False")
        queued = limited != (None, None, None) or ttl is not None or fair
        if queued and semantics != "queue":
            raise ValidationError(
                "max_in_flight_per_key, rate_limit, result_ttl and fair are for queue topics (semantics='queue')"
            )
        wanted = TopicInfo(
            name=name,
            partitions=partitions,
            semantics=semantics,
            cleanup=cleanup,
            retention=None if retention_s is None else timedelta(seconds=retention_s),
            tombstone_retention=None if tombstone_s is None else timedelta(seconds=tombstone_s),
            namespace=namespace,
            task=task,
            max_message_bytes=limit,
            dedupe_window=None if dedupe_s is None else timedelta(seconds=dedupe_s),
        )
        params = topic_sql.CreateTopicParams(
            name=name,
            partitions=partitions,
            semantics=semantics,
            cleanup=cleanup,
            retention_seconds=retention_s,
            tombstone_retention_seconds=tombstone_s,
            namespace=namespace,
            task=task,
            max_message_bytes=limit,
            dedupe_window_seconds=dedupe_s,
        )
        with db.translate_errors():
            async with self.pool.acquire() as conn:
                await topic_sql.create_topic(conn, params, self.channels.topics)
                row = await topic_sql.get_topic(conn, name)
        if row is None:  # deleted between the two statements by someone else
            raise TopicConflictError(f"topic {name!r} was deleted while being created; create it again")
        existing = topic_info(row)
        if msgspec_replace_created(existing) != wanted:
            raise TopicConflictError(
                f"topic {name!r} already exists with a different configuration ({_describe_diff(existing, wanted)}); "
                "use another name, or delete the topic first"
            )
        self.publisher.topics[name] = existing
        if queued:
            await queue_features.apply(self.context, name, limited=limited, ttl=ttl, fair=fair or None)
        return existing

    async def list_topics(self, namespace: str | None = None, task: str | None = None) -> list[TopicInfo]:
        """Every topic, optionally only those with the given namespace and/or task label."""
        if namespace is not None:
            validate_name(namespace, "namespace")
        if task is not None:
            validate_name(task, "task")
        with db.translate_errors():
            rows = await topic_sql.list_topics(self.pool, namespace, task)
        return [topic_info(r) for r in rows]

    async def delete_topic(self, name: str) -> None:
        """Delete a topic, its partitions and messages (and every group's positions on it)."""
        validate_name(name, "topic name")
        with db.translate_errors():
            async with self.pool.acquire() as conn:
                deleted = await topic_sql.delete_topic(conn, name)
        self.publisher.forget_topic(name)
        if not deleted:
            raise TopicNotFoundError(f"topic {name!r} does not exist; list them with `bus topics`")

    async def topic(self, name: str) -> TopicInfo:
        """The topic's configuration (cached: topic configuration never changes in place)."""
        return await self.publisher.topic(name)

    async def partition_id(self, topic: TopicInfo, partition: str, *, create: bool) -> int | None:
        """The internal id of a partition; dynamic partitions are created when `create`."""
        return await self.publisher.partition_id(topic, partition, create=create)

    # -- publishing (bus.publishing.Publisher) ---------------------------------------

    async def publish(
        self,
        topic: str,
        payload: Any,
        *,
        key: str | None = None,
        partition: str | int | None = None,
        headers: dict[str, str] | None = None,
        connection: asyncpg.Connection | None = None,
        idempotency_key: str | None = None,
        delay: timedelta | float | None = None,
        deliver_at: datetime | None = None,
        priority: int | None = None,
        unique: Unique | None = None,
    ) -> Record:
        """Append one message. With `connection`, inside the caller's transaction (outbox).

        With `idempotency_key`, a publish repeated within the topic's `dedupe_window` writes nothing
        and returns the original Record: retry a publish whose outcome is unknown with the same key.
        `delay`/`deliver_at` (not taken before) and `priority` (higher first among due jobs) are for
        queue topics; on a pubsub topic they raise ValidationError and nothing is written.
        `unique=bus.Unique(key, period=...)` (queue topics): while a job published with that key is
        waiting or running (or was published within `period`), returns that job's Record and adds
        nothing, whatever the number of processes publishing it at once (see bus.job_features).
        """
        if unique is not None:
            from bus import job_features

            publish = {
                "key": key,
                "partition": partition,
                "headers": headers,
                "idempotency_key": idempotency_key,
                "delay": delay,
                "deliver_at": deliver_at,
                "priority": priority,
            }
            return await job_features.publish_unique(self, topic, payload, unique, connection, publish)
        timed = (
            None
            if delay is None and deliver_at is None and priority is None
            else (delay, deliver_at, priority)
        )
        if tracing.wanted():
            with tracing.publishing(topic, 1) as trace:
                return await self.publisher.publish(
                    topic, payload, key, partition, headers, connection, idempotency_key, trace, timed
                )
        return await self.publisher.publish(
            topic, payload, key, partition, headers, connection, idempotency_key, None, timed
        )

    async def publish_many(
        self, topic: str, messages: Sequence[Outgoing | Any], *, connection: asyncpg.Connection | None = None
    ) -> list[Record]:
        """Append many messages atomically (all or none); records come back in input order.

        A message with an `idempotency_key` already written within the window is not written again:
        its record is the original's (so is a later message of the batch with the same key).
        """
        return await self.publisher.publish_many(topic, messages, connection=connection)

    # -- the other delivery modes (each in its own module, imported on first use) --------

    async def schedule(
        self,
        name: str,
        *,
        cron: str,
        topic: str,
        payload: Any,
        timezone: str = "UTC",
        catch_up: str = "one",
    ) -> bool:
        """Publish `payload` to `topic` at every tick of `cron` in `timezone`, once per tick across processes.

        `catch_up` says what happens to ticks missed while no bus ran: "one" publishes the latest,
        "none" skips them, "all" publishes each. The same definition again writes nothing (False);
        a different one replaces it from its next tick on. Bad input raises ValidationError.
        """
        from actors.scheduler import Check
        from bus import schedules

        changed = await schedules.define(self.context, name, cron, topic, payload, timezone, catch_up)
        if changed and self._scheduler is not None:  # this process's scheduler learns of it at once
            self._scheduler.try_tell(Check())
        return changed

    async def unschedule(self, name: str) -> bool:
        """Delete the schedule `name` (no tick of it is published after this returns); False if none."""
        from bus import schedules

        return await schedules.remove(self.context, name)

    async def schedules(self) -> list[ScheduleInfo]:
        """Every schedule of the schema, by name."""
        from bus import schedules

        return await schedules.list_schedules(self.context)

    def event_store(self, name: str) -> EventStore:
        """The event store `name`: one globally ordered log with attribute partitions (see bus.eventstore)."""
        from bus.eventstore import EventStore

        return EventStore(self.context, validate_name(name, "event store name"))

    async def claim(
        self,
        group: str,
        topic: str | None = None,
        *,
        namespace: str | None = None,
        task: str | None = None,
        worker_id: str,
        max_messages: int = 100,
        lease_time: float | None = None,
        start: Any = None,
    ) -> Claim | None:
        """Lease the free partition with the earliest pending message (see bus.claims); None when nothing is pending."""
        from bus.claims import claim

        return await claim(
            self.context,
            group,
            topic=topic,
            namespace=namespace,
            task=task,
            worker_id=worker_id,
            max_messages=max_messages,
            lease_time=lease_time,
            start=start,
        )

    def queue_consumer(
        self,
        topic: str,
        *,
        visibility_timeout: float = 30.0,
        max_attempts: int = 5,
        dead_letter: str | None = None,
        ordered_by_key: bool = False,
    ) -> QueueConsumer:
        """Competing consumers on a `semantics="queue"` topic (see bus.queues)."""
        from bus.queues import QueueConsumer

        return QueueConsumer(
            self.context,
            topic,
            visibility_timeout=visibility_timeout,
            max_attempts=max_attempts,
            dead_letter=dead_letter,
            ordered_by_key=ordered_by_key,
        )

    async def worker(
        self,
        topic: str,
        handler: JobHandler,
        *,
        concurrency: int = 1,
        visibility_timeout: float = 30.0,
        max_attempts: int = 5,
        dead_letter: str | None = None,
        ordered_by_key: bool = False,
        backoff: float | timedelta = 1.0,
        max_backoff: float | timedelta = 60.0,
    ) -> Worker:
        """Run `handler` on the jobs of a queue topic, `concurrency` jobs in hand at once (see bus.worker).

        One take for every free slot, the ack written after the handler returns (its return
        value, if not None, is the job's result); a handler that raises nacks its job with a
        doubling backoff, and its `max_attempts`-th failure dead-letters it. `await w.stop()`
        lets the jobs in hand finish.
        """
        from bus.worker import Worker

        worker = Worker(
            self.context,
            topic,
            handler,
            concurrency=concurrency,
            visibility_timeout=visibility_timeout,
            max_attempts=max_attempts,
            dead_letter=dead_letter,
            ordered_by_key=ordered_by_key,
            backoff=backoff,
            max_backoff=max_backoff,
        )
        return await worker.start()

    async def job_status(self, topic: str, rec: Record) -> JobStatus:
        """What became of a queue job: state, attempts, progress, result or errors (see bus.JobStatus)."""
        from bus import job_features

        return await job_features.job_status(self.context, topic, rec)

    async def publish_group(
        self,
        topic: str,
        jobs: Sequence[Outgoing | Any],
        *,
        on_complete: Outgoing,
        connection: asyncpg.Connection | None = None,
    ) -> JobGroup:
        """Publish jobs as a group (one transaction): `on_complete` (a bus.Outgoing naming its `topic`)
        is published once, in the transaction that acks, dead-letters or cancels the group's last job."""
        from bus import job_features

        return await job_features.publish_group(self, topic, jobs, on_complete, connection)

    @overload
    async def job_result(
        self,
        topic: str,
        rec: Record,
        *,
        timeout: float | timedelta = ...,  # noqa: ASYNC109 - the public API's shape
    ) -> Any: ...

    @overload
    async def job_result(
        self,
        topic: str,
        rec: Record,
        *,
        timeout: float | timedelta = ...,  # noqa: ASYNC109 - the public API's shape
        type: type[T],
    ) -> T: ...

    async def job_result(
        self,
        topic: str,
        rec: Record,
        *,
        timeout: float | timedelta = 30.0,  # noqa: ASYNC109 - the public API's shape
        type: type[T] = Any,  # type: ignore[assignment]
    ) -> T:
        """The result a queue job was acked with, decoded into `type` as `Message.value` does, waiting up to `timeout` seconds.

        Without `type` the JSON value (None: acked without one); with one, a job acked without a
        result decodes as null (ask for `T | None` where that can happen), and a result of another
        shape raises bus.errors.MessageDecodeError naming the job. Raises bus.errors.JobFailedError
        (with the error history) if the job was dead-lettered or cancelled, TimeoutError if neither
        happened in time (see bus.queue_features).
        """
        result: T = await queue_features.job_result(self.context, topic, rec, timeout, type)
        return result

    # -- durable workflows (bus.workflows) ---------------------------------------------

    def workflow(
        self, name: str, *, version: str = "1"
    ) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
        """`@b.workflow("checkout")`: register an async function `(ctx, *args)` as a durable workflow.

        Every process that registers it executes its runs (queued on the topic `workflows.<name>`).
        New runs start on the newest version registered here; a run keeps the version it started
        on, so registering the old code under its version beside the new one finishes old runs.
        """
        from bus.workflows.engine import engine_of

        def register(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
            engine_of(self.context).register(name, version, fn)
            return fn

        return register

    async def start_workflow(
        self,
        name: str,
        *args: Any,
        workflow_id: str | None = None,
        version: str | None = None,
        priority: int | None = None,
    ) -> WorkflowHandle:
        """Start a run of the workflow `name` with `args`; the same `workflow_id` again is the same run."""
        from bus.workflows.engine import engine_of

        return await engine_of(self.context).start_run(name, args, workflow_id, version, priority)

    async def workflow_result(self, workflow_id: str, *, timeout: float | timedelta | None = None) -> Any:  # noqa: ASYNC109 - the public API's shape
        """The run's return value (see WorkflowHandle.result)."""
        from bus.workflows.engine import engine_of

        return await engine_of(self.context).result(workflow_id, timeout)

    async def send(self, workflow_id: str, topic: str, payload: Any) -> None:
        """Send `payload` to the run's `ctx.recv(topic)` (kept until it is received)."""
        from bus.workflows.engine import engine_of

        await engine_of(self.context).send(workflow_id, topic, payload)

    async def get_event(self, workflow_id: str, key: str, *, timeout: float | timedelta | None = None) -> Any:  # noqa: ASYNC109 - the public API's shape
        """The value the run set with `ctx.set_event(key, value)`; waits up to `timeout` (None: now)."""
        from bus.workflows.engine import engine_of

        return await engine_of(self.context).get_event(workflow_id, key, timeout)

    # -- reading -------------------------------------------------------------------

    async def read(
        self, topic: str, partition: str | int = "0", offset: int = 0, max_messages: int = 500
    ) -> list[Message]:
        """Read a partition from `offset` (the reader mode: no group, no position kept)."""
        info = await self.topic(topic)
        validate_offset(offset)
        validate_int(max_messages, "max_messages", 1, 100_000)
        name = validate_partition(str(partition) if isinstance(partition, int) else partition)
        pid = await self.partition_id(info, name, create=False)
        if pid is None:
            if info.dynamic:
                return []
            raise ValidationError(f"topic {topic!r} has no partition {name!r}")
        with db.translate_errors():
            # On the Lender's connections: generic plans (PostgreSQL re-plans this read on every
            # call otherwise, once `messages` is large; see storage.db.GENERIC_PLANS).
            rows = await log_sql.read(self.lender, pid, offset, max_messages)
            if not rows or rows[0]["offset"] != offset:
                bounds = await log_sql.bounds(self.lender, pid)
                if bounds is not None and offset < bounds[0]:
                    raise OffsetOutOfRangeError(
                        f"offset {offset} of {topic}/{name} is below the log start {bounds[0]}: earlier history "
                        f"was removed by retention or compaction (see the archive); read from {bounds[0]}",
                        log_start=bounds[0],
                    )
        return [to_message(topic, name, r) for r in rows]


def msgspec_replace_created(info: TopicInfo) -> TopicInfo:
    return msgspec.structs.replace(info, created_at=None)


def _describe_diff(existing: TopicInfo, wanted: TopicInfo) -> str:
    diffs = []
    for field in TopicInfo.__struct_fields__:
        if field == "created_at":
            continue
        a, b = getattr(existing, field), getattr(wanted, field)
        if a != b:
            diffs.append(f"{field}: existing {a!r}, requested {b!r}")
    return "; ".join(diffs)


class _Connector:
    """What `connect()` returns: `async with connect() as b` or `b = await connect()`."""

    def __init__(self, dsn: str | None, overrides: dict[str, Any], *, actors: bool = True) -> None:
        self._dsn = dsn
        self._overrides = overrides
        self._actors = actors
        self._bus: Bus | None = None

    def __await__(self) -> Generator[Any, None, Bus]:
        return self._open().__await__()

    async def __aenter__(self) -> Bus:
        self._bus = await self._open()
        return self._bus

    async def __aexit__(self, *exc: object) -> None:
        if self._bus is not None:
            await self._bus.close()

    async def _open(self) -> Bus:
        config = Config.load(self._overrides)
        dsn = self._dsn or os.environ.get("BUS_DSN") or None
        embedded = None
        if dsn is None:
            from bus.server.embedded import ensure_server

            # asyncio's thread, not anyio's: every `bus` command on the embedded server comes here, and
            # loading anyio's backend (about 20 ms) would cost a command that prints a table ~5 %.
            embedded = await asyncio.to_thread(ensure_server)
            dsn = embedded.dsn
        pooler = cast("db.Pooler", config.pooler)
        with db.translate_errors():
            conn = await db.connect(dsn, config.schema, pooler=pooler)
            try:
                applied = await db.migrate(conn, config.schema)
            finally:
                await conn.close()
        # The one line a connect logs at INFO; each migration is at DEBUG.
        log.info("migrations_applied", schema=config.schema, count=len(applied))
        pool = await db.create_pool(
            dsn, config.schema, min_size=config.pool_min_size, max_size=config.pool_max_size, pooler=pooler
        )
        b = Bus(dsn, config, pool, embedded)
        if not self._actors:
            return b
        try:
            await b._start()
        except BaseException:
            await b.close()
            raise
        log.debug("bus_connected", schema=config.schema)
        return b


def connect_admin(dsn: str | None = None, **config: Any) -> _Connector:
    """`connect()` for a short administrative look (the CLI's read-only commands): no actors started.

    Migrations are applied and the pool opened as by `connect()`, with one connection to start
    with; the heartbeat monitor, retention cleaner, scheduler and Producer are not started (a
    publish writes directly; a consumer starts the group actors when it joins).
    """
    return _Connector(dsn, {"pool_min_size": 1, **config}, actors=False)


def connect(dsn: str | None = None, **config: Any) -> _Connector:
    """Connect to the bus: `dsn`, else `$BUS_DSN`, else the embedded PostgreSQL under `$BUS_HOME`.

    Applies migrations (safe when many processes start at once) and starts the
    HeartbeatMonitor. Use as `async with bus.connect() as b:` (or `b = await bus.connect()`
    and `await b.close()`).
    """
    return _Connector(dsn, config)
