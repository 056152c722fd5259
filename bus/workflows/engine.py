"""The workflow engine of one Bus: the registry, the workers that run runs, leases and wake-ups.

A run is a row of `workflow_runs` and a job on its workflow's queue topic
(`workflows.<name>`), published in the transaction that creates the row. A
worker that takes the job claims the run (the claim bumps the run's epoch and
gives this process its lease), acks the job, and executes the workflow
function, replaying recorded steps. The process renews the leases of the runs
it executes; a run whose lease lapsed (its process died) is put back to
pending with a new job by whichever process sees it first, and resumes from
its last recorded step elsewhere. A long sleep parks the run and publishes a
delayed job for its wake-up time. Waits (recv, children, results, events)
listen on the schema's workflows channel, whose NOTIFY payload is a run's id;
`wait_for` listens to its topic's partitions through the Bus's Notifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import socket
import time
import typing
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from bus.types import Outgoing
from bus.workflows.context import Lost, Parked, Recorded, WorkflowContext
from bus.workflows.errors import (
    WorkflowCancelledError,
    WorkflowFailedError,
    WorkflowNotFoundError,
    WorkflowVersionError,
)
from bus.workflows.types import StepInfo, WorkflowInfo
from storage import db
from storage import workflows as sql
from storage.availability import is_unavailable
from storage.errors import ValidationError
from storage.logs import get_logger
from storage.names import validate_int, validate_name, validate_seconds

if TYPE_CHECKING:
    import asyncpg

    from bus.context import BusContext
    from bus.queues import QueueConsumer, _Doorbell

log = get_logger(__name__)

__all__ = ["Engine", "WorkflowHandle", "engine_of"]

_QUEUE_PREFIX = "workflows."
_DEFAULT_VERSION = "1"
# A sleep longer than this parks the run (a delayed job wakes it); a shorter one sleeps in the process.
_PARK_AFTER = 2.0
# The timer job comes this much before the wake-up time; the rest is slept in the process that takes it.
_TIMER_LEAD = 0.5
# A run of a version this process does not have goes back to the queue for this long.
_OTHER_VERSION_DELAY = 5.0
# A run interrupted because the database went away is taken up again this long after it is given
# back (its next executor replays the recorded steps and goes on from the first unrecorded one).
_INTERRUPTED_DELAY = 0.5
_MAX_RUNS = 256  # runs executing at once in one process
_encoder = msgspec.json.Encoder()


def _check_id(workflow_id: object) -> str:
    if not isinstance(workflow_id, str) or not 1 <= len(workflow_id) <= 200 or not workflow_id.isprintable():
        raise ValidationError(
            f"invalid workflow_id {workflow_id!r}: use 1 to 200 printable characters (e.g. f'order-{{id}}')"
        )
    return workflow_id


class Registered(msgspec.Struct, frozen=True):
    """One registered workflow function and the types its arguments and result decode to."""

    name: str
    version: str
    fn: Any
    queue: str
    arg_types: tuple[Any, ...]
    returns: Any


class WorkflowHandle:
    """A started run: `await handle.result(timeout=60)`."""

    def __init__(self, engine: Engine, workflow_id: str, name: str | None = None) -> None:
        self._engine = engine
        self.workflow_id = workflow_id
        self.name = name

    def __repr__(self) -> str:
        return f"WorkflowHandle({self.workflow_id!r})"

    async def result(self, timeout: float | timedelta | None = None) -> Any:  # noqa: ASYNC109 - the public API's shape
        """The run's return value, waiting up to `timeout` seconds (None: as long as it takes).

        Raises WorkflowFailedError (or WorkflowVersionError) if it failed, WorkflowCancelledError
        if it was cancelled, TimeoutError if it has not finished in time.
        """
        return await self._engine.result(self.workflow_id, timeout)

    async def status(self) -> WorkflowInfo:
        """The run as `b.admin.workflow(id)` shows it."""
        return await self._engine.info(self.workflow_id)


class Engine:
    """The registry and the executor of workflow runs for one Bus."""

    def __init__(self, ctx: BusContext) -> None:
        self.ctx = ctx
        # A named executor (config `workflow_executor`) is the same owner after a restart, so the
        # process takes its previous incarnation's runs back at once instead of waiting out their leases.
        self.executor = ctx.config.workflow_executor
        self.owner = self.executor or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.channel = f"{ctx.config.schema}.workflows"
        self.lease = float(ctx.config.lease_time)
        self.park_after = _PARK_AFTER
        self.max_runs = _MAX_RUNS
        self._registry: dict[str, dict[str, Registered]] = {}
        self._latest: dict[str, str] = {}
        self._queues: set[str] = set()  # queue topics known to exist
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(self.max_runs)
        self._background: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._listener: asyncpg.Connection | None = None
        self._listen_lock = asyncio.Lock()
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._bells: dict[str, _Doorbell] = {}
        self._wakers: list[Any] = []
        self._closed = False
        self._recovered = asyncio.Event()  # the workers take runs once a named executor took its own back
        self._log = log.bind(owner=self.owner)

    # -- registry ------------------------------------------------------------------

    def register(self, name: str, version: str, fn: Callable[..., Awaitable[Any]]) -> None:
        """Register `fn` as the workflow `name` at `version` and start this process's worker for it."""
        validate_name(name, "workflow name")
        if len(name) > 190:
            raise ValidationError(f"workflow name {name!r} is too long: at most 190 characters")
        if not isinstance(version, str) or not version:
            raise ValidationError("a workflow version is a non-empty str (e.g. version='2')")
        if not callable(fn):
            raise ValidationError("@b.workflow(...) decorates an async function taking (ctx, *args)")
        hints = _hints(fn)
        params = list(inspect.signature(fn).parameters.values())[1:]
        arg_types = tuple(hints.get(p.name, Any) for p in params)
        queue = _QUEUE_PREFIX + name
        self._registry.setdefault(name, {})[version] = Registered(
            name, version, fn, queue, arg_types, hints.get("return", Any)
        )
        self._latest[name] = version
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # started by the first start_workflow on a running loop
        self.start()

    def start(self) -> None:
        """Start the workers of every registered workflow and the lease heartbeat (idempotent)."""
        if self._closed:
            return
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        for name, versions in self._registry.items():
            queue = _QUEUE_PREFIX + name
            if queue not in self._workers and versions:
                self._workers[queue] = asyncio.get_running_loop().create_task(self._work(queue))

    def result_type(self, name: str, version: str | None) -> Any:
        versions = self._registry.get(name, {})
        reg = versions.get(version or self._latest.get(name, _DEFAULT_VERSION))
        return reg.returns if reg is not None else Any

    @staticmethod
    def return_type(fn: Callable[..., Any]) -> Any:
        return _hints(fn).get("return", Any)

    def encode(self, value: Any, what: str) -> bytes:
        try:
            return _encoder.encode(value)
        except (TypeError, msgspec.EncodeError) as exc:
            raise ValidationError(
                f"{what} must be msgspec-encodable (a Struct, dict, list, str, number, None): {exc}"
            ) from None

    def decode(self, data: bytes | None, kind: Any) -> Any:
        if data is None:
            return None
        return _decoder(kind).decode(data)

    # -- starting runs -------------------------------------------------------------

    async def _queue(self, queue: str) -> None:
        if queue not in self._queues:
            await self.ctx.create_topic(queue, partitions=1, semantics="queue")
            # A run's job is published in the transaction that creates the run, on a pool
            # connection: its partition must be known before (no second connection inside).
            await self.ctx.resolve(queue)
            self._queues.add(queue)

    async def create(
        self,
        workflow_id: str,
        name: str,
        args: Sequence[Any],
        *,
        version: str | None = None,
        parent_id: str | None = None,
        priority: int | None = None,
    ) -> bool:
        """Create the run and its job in one transaction; False when the id already had a run."""
        _check_id(workflow_id)
        validate_name(name, "workflow name")
        version = version or self._latest.get(name, _DEFAULT_VERSION)
        queue = _QUEUE_PREFIX + name
        await self._queue(queue)
        data = self.encode(list(args), f"the arguments of workflow {name!r}")
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn, conn.transaction():
                row = await sql.create(
                    conn,
                    sql.CreateParams(
                        workflow_id=workflow_id,
                        name=name,
                        version=version,
                        queue=queue,
                        payload=data,
                        parent_id=parent_id,
                    ),
                )
                if row["inserted"]:
                    await self._kick(conn, queue, workflow_id, priority=priority)
        if row["name"] != name:
            raise ValidationError(
                f"workflow_id {workflow_id!r} is already a run of workflow {row['name']!r}, not {name!r}"
            )
        return bool(row["inserted"])

    async def _kick(
        self,
        conn: Any,
        queue: str,
        workflow_id: str,
        *,
        at: datetime | None = None,
        delay: float | None = None,
        priority: int | None = None,
    ) -> None:
        """The run's job (on the caller's transaction)."""
        await self.ctx.publish_many(
            queue,
            [Outgoing({"id": workflow_id}, deliver_at=at, delay=delay, priority=priority)],
            connection=conn,
        )

    async def start_run(
        self,
        name: str,
        args: Sequence[Any],
        workflow_id: str | None,
        version: str | None,
        priority: int | None,
    ) -> WorkflowHandle:
        wid = _check_id(workflow_id) if workflow_id is not None else uuid.uuid4().hex
        if priority is not None:
            validate_int(priority, "priority", -(1 << 30), 1 << 30)
        self.start()
        await self.create(wid, name, args, version=version, priority=priority)
        return WorkflowHandle(self, wid, name)

    # -- the workers ---------------------------------------------------------------

    async def _work(self, queue: str) -> None:
        """Take the queue's jobs and execute their runs, at most `max_runs` at once in this process."""
        from bus.queues import QueueConsumer

        await self._recovered.wait()
        while not self._closed:
            try:
                await self._queue(queue)
                consumer = QueueConsumer(
                    self.ctx, queue, visibility_timeout=self.lease, max_attempts=1_000_000
                )
                async with consumer:
                    while not self._closed:
                        await self._slots.acquire()
                        free = 1
                        while free < 10 and not self._slots.locked():
                            await self._slots.acquire()
                            free += 1
                        try:
                            jobs = await consumer.take(max_messages=free, timeout=1.0)
                        except BaseException:
                            for _ in range(free):
                                self._slots.release()
                            raise
                        for _ in range(free - len(jobs)):
                            self._slots.release()
                        for job in jobs:
                            self._spawn(self._take_over(consumer, job))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log.warning("workflow_worker_failed", queue=queue, error=repr(exc))
                await asyncio.sleep(1.0)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _take_over(self, consumer: QueueConsumer, job: Any) -> None:
        try:
            wid = msgspec.json.decode(job.payload or b"{}").get("id")
            row = None
            if isinstance(wid, str):
                with db.translate_errors():
                    row = await sql.claim(self.ctx.pool, wid, self.owner, self.lease)
            try:
                await consumer.ack(job)
            except Exception as exc:  # the job comes back and finds the run claimed: nothing runs twice
                self._log.warning("workflow_job_ack_failed", error=repr(exc))
            if row is not None:
                await self._execute(row)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The job comes back by its visibility timeout, or the run's lease lapses: nothing is lost.
            self._log.warning("workflow_take_over_failed", error=repr(exc))
        finally:
            self._slots.release()

    async def _execute(self, row: asyncpg.Record) -> None:
        wid, name, version, epoch = row["workflow_id"], row["name"], row["version"], row["epoch"]
        reg = self._registry.get(name, {}).get(version)
        if reg is None:
            await self._give_back(wid, epoch)
            return
        with db.translate_errors():
            records = {
                r["seq"]: Recorded(r["name"], r["kind"], r["output"], r["error"])
                for r in await sql.steps(self.ctx.pool, wid)
            }
        ctx = WorkflowContext(self, wid, epoch, records, row["created_at"])
        task = asyncio.current_task()
        assert task is not None
        self._runs[wid] = task
        try:
            await self._run(reg, ctx, row["input"])
        except (Lost, Parked):
            pass
        finally:
            if self._runs.get(wid) is task:
                del self._runs[wid]

    async def _run(self, reg: Registered, ctx: WorkflowContext, data: bytes) -> None:
        try:
            raw = msgspec.json.decode(data)
            args = [
                msgspec.convert(v, t, strict=False) if t is not Any else v
                for v, t in zip(raw, reg.arg_types, strict=False)
            ]
            args.extend(raw[len(reg.arg_types) :])
            result = await reg.fn(ctx, *args)
        except (Lost, Parked, asyncio.CancelledError):
            raise
        except WorkflowVersionError as exc:
            await self._finish(ctx, "failed", None, str(exc), "WorkflowVersionError")
            return
        except Exception as exc:
            if is_unavailable(exc):
                # The database went away under the run (a restart, a failover, a lost connection):
                # not the workflow's failure. Nothing unrecorded is kept, so the run goes back to its
                # queue and resumes from its last recorded step.
                self._log.warning("workflow_run_interrupted", workflow_id=ctx.workflow_id, error=repr(exc))
                await self._interrupted(ctx)
                return
            errors = await ctx.compensate()
            message = str(exc) + (f" (compensations failed: {'; '.join(errors)})" if errors else "")
            await self._finish(ctx, "failed", None, message, type(exc).__name__)
            return
        output = self.encode(result, f"the result of workflow {reg.name!r}")
        await self._finish(ctx, "succeeded", output, None, None)

    async def _finish(
        self,
        ctx: WorkflowContext,
        status: str,
        output: bytes | None,
        error: str | None,
        error_type: str | None,
    ) -> None:
        with db.translate_errors():
            await sql.finish(
                self.ctx.pool,
                sql.FinishParams(
                    workflow_id=ctx.workflow_id,
                    epoch=ctx.epoch,
                    status=status,
                    output=output,
                    error=error,
                    error_type=error_type,
                    channel=self.channel,
                ),
            )

    async def _interrupted(self, ctx: WorkflowContext) -> None:
        """Give back a run the database's absence interrupted; if it is still away, the run's lease lapses."""
        try:
            await self._give_back(ctx.workflow_id, ctx.epoch, delay=_INTERRUPTED_DELAY)
        except Exception as exc:  # still away: the lease lapses and a process takes the run over
            self._log.debug("workflow_give_back_failed", workflow_id=ctx.workflow_id, error=repr(exc))

    async def _give_back(self, wid: str, epoch: int, delay: float = _OTHER_VERSION_DELAY) -> None:
        """Back to the queue for another process (a run of a version this process lacks, or interrupted)."""
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn, conn.transaction():
                queue = await sql.release(conn, wid, epoch)
                if queue is not None:
                    await self._kick(conn, queue, wid, delay=delay)

    async def park(self, ctx: WorkflowContext, wake_at: float) -> None:
        """Park the run until `wake_at` (epoch seconds): a delayed job resumes it. Raises Parked."""
        when = datetime.fromtimestamp(wake_at, UTC)
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn, conn.transaction():
                queue = await sql.park(conn, ctx.workflow_id, ctx.epoch, when)
                if queue is None:
                    raise Lost()
                await self._kick(conn, queue, ctx.workflow_id, at=when - timedelta(seconds=_TIMER_LEAD))
        raise Parked()

    async def _beat(self) -> None:
        """Renew this process's run leases; put back runs whose process died; keep the LISTEN up."""
        await self._recover()
        while not self._closed:
            try:
                with db.translate_errors():
                    await sql.renew(self.ctx.pool, self.owner, self.lease, list(self._runs))
                    await self._reap()
                await self._ensure_listening()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log.warning("workflow_heartbeat_failed", error=repr(exc))
            await asyncio.sleep(max(0.05, self.lease / 3))

    async def _recover(self) -> None:
        """A named executor starting lets the leases of its previous incarnation's runs lapse at once.

        Nothing of this process runs yet (its workers wait for this), so every running run under its
        name was left by a process that died or was stopped; the first reap gives them back to their
        queues. Failing (the database away), the runs come back when their leases lapse.
        """
        try:
            if self.executor is not None:
                with db.translate_errors():
                    async with self.ctx.pool.acquire() as conn:
                        await sql.drop_leases(conn, self.owner)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._log.warning("workflow_recovery_failed", error=repr(exc))
        finally:
            self._recovered.set()

    async def _reap(self) -> None:
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            for r in await sql.lapsed(conn, 100):
                await self._queue(r["queue"])
                await self._kick(conn, r["queue"], r["workflow_id"])
                self._log.info("workflow_run_lapsed", workflow_id=r["workflow_id"])

    async def close(self) -> None:
        """Stop the workers and the runs executing here; give those runs back to the queue at once."""
        if self._closed:
            return
        self._closed = True
        tasks = [*self._workers.values(), *self._background]
        if self._heartbeat is not None:
            tasks.append(self._heartbeat)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._runs:
            with contextlib.suppress(Exception), db.translate_errors():
                async with self.ctx.pool.acquire() as conn, conn.transaction():
                    await sql.drop_leases(conn, self.owner)
                    await self._reap()
        for waker in self._wakers:
            with contextlib.suppress(Exception):
                await waker.stop(drain=False)
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()
            self._listener = None

    # -- waiting -------------------------------------------------------------------

    async def _ensure_listening(self) -> None:
        """One LISTEN connection on the workflows channel (none through a transaction pooler
        without direct_dsn: waits poll)."""
        c = self.ctx.config
        if not c.listens or self._closed:
            return
        async with self._listen_lock:
            if self._listener is not None and not self._listener.is_closed():
                return
            pooler = typing.cast("db.Pooler", None if c.direct_dsn else c.pooler)
            conn = await db.connect(c.direct_dsn or self.ctx.dsn, c.schema, pooler=pooler)
            await conn.add_listener(self.channel, self._heard)
            self._listener = conn
        for events in self._watchers.values():  # what was notified while no one listened
            for event in events:
                event.set()

    def _heard(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        for event in self._watchers.get(str(payload), ()):
            event.set()

    @contextlib.contextmanager
    def watching(self, workflow_id: str) -> Iterator[asyncio.Event]:
        """An event set by every NOTIFY of `workflow_id` while the block lasts (register, then look)."""
        event = asyncio.Event()
        self._watchers.setdefault(workflow_id, set()).add(event)
        try:
            yield event
        finally:
            events = self._watchers.get(workflow_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._watchers[workflow_id]

    def wait_slice(self, deadline: float | None) -> float:
        poll = (
            self.ctx.config.fallback_poll
            if self._listener is not None
            else min(0.25, self.ctx.config.fallback_poll)
        )
        if deadline is None:
            return poll
        return max(0.0, min(poll, deadline - time.time()))

    async def wait_event(self, event: asyncio.Event, deadline: float | None) -> None:
        await self._ensure_listening()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), self.wait_slice(deadline))

    async def check_held(self, ctx: WorkflowContext) -> None:
        """Raise Lost if the run was cancelled or taken over while it waited."""
        with db.translate_errors():
            row = await sql.status(self.ctx.pool, ctx.workflow_id)
        if row is None or row["epoch"] != ctx.epoch or row["status"] != "running":
            raise Lost()

    async def topic_bell(self, topic: str) -> _Doorbell:
        """A doorbell rung by every NOTIFY of `topic`'s partitions (through the Bus's Notifier)."""
        bell = self._bells.get(topic)
        if bell is not None:
            return bell
        from bus.queues import QueueWaker, _Doorbell

        info = await self.ctx.topic(topic)
        bell = self._bells[topic] = _Doorbell()
        system = await self.ctx.group_system()
        notifier = system.notifier
        assert notifier is not None
        with db.translate_errors():
            pids = await sql.topic_partitions(self.ctx.pool, topic)
        keys: tuple[str | None, ...] = (None,) if info.dynamic else tuple(str(p) for p in pids)
        waker = system.root.spawn(lambda: QueueWaker(notifier, bell), f"workflow-waker-{topic}")
        self._wakers.append(waker)
        await QueueWaker.subscribe(notifier, waker, self.ctx.channels.messages, keys)
        return bell

    async def outcome(
        self,
        workflow_id: str,
        timeout: float | None = None,  # noqa: ASYNC109 - a wait bounded by the caller's deadline
        held_by: WorkflowContext | None = None,
    ) -> asyncpg.Record:
        """The run's status row once it is finished (succeeded, failed or cancelled)."""
        deadline = None if timeout is None else time.time() + timeout
        with self.watching(workflow_id) as heard:
            while True:
                heard.clear()
                with db.translate_errors():
                    row = await sql.status(self.ctx.pool, workflow_id)
                if row is None:
                    raise WorkflowNotFoundError(f"no workflow run has id {workflow_id!r}")
                if row["status"] in sql.TERMINAL:
                    return row
                if deadline is not None and time.time() >= deadline:
                    raise TimeoutError(f"workflow run {workflow_id!r} has not finished after {timeout:g}s")
                if held_by is not None:
                    with self.watching(held_by.workflow_id) as own:
                        await self.check_held(held_by)
                        await self._wait_either(heard, own, deadline)
                else:
                    await self.wait_event(heard, deadline)

    async def _wait_either(self, a: asyncio.Event, b: asyncio.Event, deadline: float | None) -> None:
        await self._ensure_listening()
        waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
        try:
            await asyncio.wait(waits, timeout=self.wait_slice(deadline), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def result(self, workflow_id: str, timeout: float | timedelta | None) -> Any:  # noqa: ASYNC109 - the public API's shape
        _check_id(workflow_id)
        wait = None if timeout is None else validate_seconds(timeout, "timeout", allow_zero=True)
        row = await self.outcome(workflow_id, wait)
        status = row["status"]
        if status == "succeeded":
            return self.decode(row["output"], self.result_type(row["name"], row["version"]))
        if status == "cancelled":
            raise WorkflowCancelledError(
                f"workflow run {workflow_id!r} was cancelled; b.admin.resume_workflow({workflow_id!r}) "
                "goes on from its last recorded step"
            )
        if row["error_type"] == "WorkflowVersionError":
            raise WorkflowVersionError(row["error"] or f"workflow run {workflow_id!r} met changed code")
        raise WorkflowFailedError(
            f"workflow run {workflow_id!r} failed with {row['error_type']}: {row['error']}",
            workflow_id=workflow_id,
            error_type=row["error_type"],
            error=row["error"],
        )

    # -- messages and events ------------------------------------------------------------

    async def send(self, workflow_id: str, topic: str, payload: Any) -> None:
        _check_id(workflow_id)
        validate_name(topic, "recv topic")
        data = self.encode(payload, "a sent message")
        with db.translate_errors():
            await sql.send(self.ctx.pool, workflow_id, topic, data, self.channel)

    async def get_event(self, workflow_id: str, key: str, timeout: float | timedelta | None) -> Any:  # noqa: ASYNC109 - the public API's shape
        """The value the run set under `key`; waits up to `timeout` for it (None when not set by then)."""
        _check_id(workflow_id)
        wait = 0.0 if timeout is None else validate_seconds(timeout, "timeout", allow_zero=True)
        deadline = time.time() + wait
        with self.watching(workflow_id) as heard:
            while True:
                heard.clear()
                with db.translate_errors():
                    value = await sql.get_event(self.ctx.pool, workflow_id, key)
                if value is not None:
                    return self.decode(value, Any)
                if time.time() >= deadline:
                    return None
                await self.wait_event(heard, deadline)

    # -- admin ---------------------------------------------------------------------

    async def info(self, workflow_id: str) -> WorkflowInfo:
        _check_id(workflow_id)
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn:
                row = await sql.run(conn, workflow_id)
                if row is None:
                    raise WorkflowNotFoundError(f"no workflow run has id {workflow_id!r}")
                steps = await sql.steps(conn, workflow_id)
        return _info(row, steps)

    async def list(self, status: str | None, name: str | None, limit: int) -> list[WorkflowInfo]:
        if status is not None and status not in (*sql.ACTIVE, *sql.TERMINAL):
            raise ValidationError(f"status must be one of {', '.join((*sql.ACTIVE, *sql.TERMINAL))}")
        validate_int(limit, "limit", 1, 100_000)
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn:
                rows = await sql.list_runs(conn, status, name, limit)
                return [_info(r, await sql.steps(conn, r["workflow_id"])) for r in rows]

    async def cancel(self, workflow_id: str) -> bool:
        """Cancel the run and its unfinished children; False if it had already finished."""
        _check_id(workflow_id)
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn, conn.transaction():
                if await sql.run(conn, workflow_id) is None:
                    raise WorkflowNotFoundError(f"no workflow run has id {workflow_id!r}")
                cancelled = await sql.cancel(conn, workflow_id, self.channel)
        for wid in cancelled:
            task = self._runs.get(wid)
            if task is not None:
                task.cancel()
        return workflow_id in cancelled

    async def resume(self, workflow_id: str) -> bool:
        """A cancelled or failed run goes on from its last successful step; False if it was not one."""
        _check_id(workflow_id)
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn, conn.transaction():
                if await sql.run(conn, workflow_id) is None:
                    raise WorkflowNotFoundError(f"no workflow run has id {workflow_id!r}")
                queue = await sql.resume(conn, workflow_id)
                if queue is not None:
                    await self._queue(queue)
                    await self._kick(conn, queue, workflow_id)
        return queue is not None

    async def fork(self, workflow_id: str, from_step: int, new_id: str | None) -> WorkflowHandle:
        """A new run of the same workflow and input that keeps the records of steps before `from_step`."""
        _check_id(workflow_id)
        validate_int(from_step, "from_step", 1, 1 << 30)
        fork_id = _check_id(new_id) if new_id is not None else f"{workflow_id}-fork-{uuid.uuid4().hex[:8]}"
        with db.translate_errors():
            async with self.ctx.pool.acquire() as conn, conn.transaction():
                queue = await sql.fork(conn, workflow_id, fork_id, from_step)
                if queue is None:
                    raise WorkflowNotFoundError(f"no workflow run has id {workflow_id!r}")
                await self._queue(queue)
                await self._kick(conn, queue, fork_id)
        return WorkflowHandle(self, fork_id)


def _info(row: asyncpg.Record, steps: list[asyncpg.Record]) -> WorkflowInfo:
    return WorkflowInfo(
        workflow_id=row["workflow_id"],
        name=row["name"],
        version=row["version"],
        status=row["status"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
        executions=row["executions"],
        parent_id=row["parent_id"],
        error_type=row["error_type"],
        error=row["error"],
        owner=row["owner"],
        wake_at=row["wake_at"],
        steps=[
            StepInfo(
                seq=s["seq"],
                name=s["name"],
                kind=s["kind"],
                attempts=s["attempts"],
                started_at=s["started_at"],
                finished_at=s["finished_at"],
                error=s["error"],
                output=s["output"],
            )
            for s in steps
        ],
    )


@functools.cache
def _decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


def _hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations (a forward reference): decode as plain JSON
        return {}


def engine_of(ctx: BusContext) -> Engine:
    """The Bus's one workflow engine."""
    return ctx.state(Engine, lambda: Engine(ctx))


async def close_engine(ctx: BusContext) -> None:
    """Stop the Bus's workflow engine, if it has one (the Bus's close calls it)."""
    await engine_of(ctx).close()
