"""What a workflow function gets: `ctx.step`, `ctx.transaction`, `ctx.sleep`, waits, children.

Every call on the context takes the run's next sequence number (from 1) at the
moment it is made, so a replay of the same code meets the same numbers. A
number whose record exists returns what was recorded (a step is never called
again once recorded); a record of another name or kind at that number means
the code changed under the run: `WorkflowVersionError`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from bus.types import Message
from bus.workflows.errors import StepFailedError, WorkflowFailedError, WorkflowVersionError
from storage import db
from storage import workflows as sql
from storage.errors import ValidationError
from storage.names import validate_name, validate_seconds

if TYPE_CHECKING:
    import contextlib

    import asyncpg

    from bus.consumer import Retry
    from bus.context import BusContext
    from bus.queues import _Doorbell

__all__ = ["WorkflowContext", "WorkflowTransaction"]

T = TypeVar("T")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Lost(BaseException):  # noqa: N818 - not an error: the run moved on without this executor
    """This executor no longer holds the run (lease lapsed, cancelled): stop without writing."""


class Parked(BaseException):  # noqa: N818 - not an error: the run waits for its timer job
    """The run is parked until its timer (a delayed job) comes due: stop here, nothing is lost."""


class Engine(Protocol):
    """What a run's context asks of the engine that executes it (bus.workflows.engine.Engine)."""

    ctx: BusContext
    channel: str
    park_after: float

    def return_type(self, fn: Callable[..., Any]) -> Any: ...
    def result_type(self, name: str, version: str | None) -> Any: ...
    def encode(self, value: Any, what: str) -> bytes: ...
    def decode(self, data: bytes | None, kind: Any) -> Any: ...
    def watching(self, workflow_id: str) -> contextlib.AbstractContextManager[asyncio.Event]: ...
    def wait_slice(self, deadline: float | None) -> float: ...
    async def park(self, ctx: WorkflowContext, wake_at: float) -> None: ...
    async def check_held(self, ctx: WorkflowContext) -> None: ...
    async def wait_event(self, event: asyncio.Event, deadline: float | None) -> None: ...
    async def topic_bell(self, topic: str) -> _Doorbell: ...
    async def create(
        self,
        workflow_id: str,
        name: str,
        args: Sequence[Any],
        *,
        version: str | None = None,
        parent_id: str | None = None,
        priority: int | None = None,
    ) -> bool: ...
    async def outcome(
        self,
        workflow_id: str,
        timeout: float | None = None,  # noqa: ASYNC109 - a wait bounded by the caller's deadline
        held_by: WorkflowContext | None = None,
    ) -> asyncpg.Record: ...


class Recorded(msgspec.Struct, frozen=True):
    """A step record as the replay reads it."""

    name: str
    kind: str
    output: bytes | None
    error: str | None


class _Found(msgspec.Struct, frozen=True):
    """What a wait_for step records: the message (None: timed out) and its partition's id."""

    message: Message | None
    partition_id: int = 0


def _name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def _seconds(value: float | timedelta, what: str) -> float:
    return validate_seconds(value, what, allow_zero=True)


class WorkflowTransaction:
    """`async with ctx.transaction() as tx`: `tx.connection` writes commit with the step's record.

    On a replay of a recorded transaction step the block runs again against a
    transaction that is rolled back (`tx.replayed` is True): its writes never
    apply twice.
    """

    def __init__(self, ctx: WorkflowContext, name: str) -> None:
        self._ctx = ctx
        self._name = name
        self._seq = 0
        self._conn: Any = None
        self._tx: Any = None
        self._started = _EPOCH
        self.replayed = False

    @property
    def connection(self) -> asyncpg.Connection:
        """The transaction's connection: run the step's statements on it."""
        if self._conn is None:
            raise ValidationError(
                "use the transaction inside its `async with ctx.transaction() as tx:` block"
            )
        conn: asyncpg.Connection = self._conn
        return conn

    async def __aenter__(self) -> WorkflowTransaction:
        ctx = self._ctx
        self._seq = ctx.next_seq()
        self.replayed = ctx.recorded(self._seq, self._name, "transaction") is not None
        self._started = datetime.now(UTC)
        pool = ctx.engine.ctx.pool
        with db.translate_errors():
            self._conn = await pool.acquire()
            try:
                self._tx = self._conn.transaction()
                await self._tx.start()
            except BaseException:
                await pool.release(self._conn)
                self._conn = None
                raise
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        ctx = self._ctx
        pool = ctx.engine.ctx.pool
        conn, tx = self._conn, self._tx
        try:
            with db.translate_errors():
                if exc_type is not None or self.replayed:
                    await tx.rollback()
                    return
                written = await sql.record(
                    conn,
                    sql.RecordParams(
                        workflow_id=ctx.workflow_id,
                        epoch=ctx.epoch,
                        seq=self._seq,
                        name=self._name,
                        kind="transaction",
                        output=b"null",
                        started_at=self._started,
                    ),
                )
                if not written:
                    await tx.rollback()
                    raise Lost()
                await tx.commit()
                ctx.remember(self._seq, self._name, "transaction", b"null", None)
        finally:
            self._conn = None
            await pool.release(conn)


class WorkflowContext:
    """The handle a workflow function gets as its first argument."""

    def __init__(
        self,
        engine: Engine,
        workflow_id: str,
        epoch: int,
        records: dict[int, Recorded],
        created_at: datetime,
    ) -> None:
        self.engine = engine
        self.workflow_id = workflow_id
        self.epoch = epoch
        self.created_at = created_at
        self._records = records
        self._seq = 0
        self._compensations: list[tuple[Callable[..., Any], tuple[Any, ...], str]] = []
        # (topic, key) -> where the previous wait_for of this run on them stopped.
        self._seen: dict[tuple[str, str], tuple[datetime, int, int]] = {}

    # -- replay --------------------------------------------------------------------

    def next_seq(self) -> int:
        """The next step's sequence number."""
        self._seq += 1
        return self._seq

    def recorded(self, seq: int, name: str, kind: str) -> Recorded | None:
        """The record at `seq`, if any; WorkflowVersionError if it is of another step."""
        rec = self._records.get(seq)
        if rec is not None and (rec.name != name or rec.kind != kind):
            raise WorkflowVersionError(
                f"workflow run {self.workflow_id!r} recorded step {seq} as {rec.kind} {rec.name!r}, but the "
                f"code now calls {kind} {name!r} there: run it on the code that started it (register that "
                "code under its version beside the new one)"
            )
        return rec

    def remember(self, seq: int, name: str, kind: str, output: bytes | None, error: str | None) -> None:
        """Keep a record just written, for a replay within this execution."""
        self._records[seq] = Recorded(name, kind, output, error)

    async def _record(
        self,
        seq: int,
        name: str,
        kind: str,
        output: bytes | None,
        error: str | None = None,
        attempts: int = 1,
        started: datetime | None = None,
        conn: Any = None,
    ) -> None:
        with db.translate_errors():
            written = await sql.record(
                conn if conn is not None else self.engine.ctx.pool,
                sql.RecordParams(
                    workflow_id=self.workflow_id,
                    epoch=self.epoch,
                    seq=seq,
                    name=name,
                    kind=kind,
                    output=output,
                    error=error,
                    attempts=attempts,
                    started_at=started or datetime.now(UTC),
                ),
            )
        if not written:
            raise Lost()
        self.remember(seq, name, kind, output, error)

    # -- steps ---------------------------------------------------------------------

    def step(
        self,
        fn: Callable[..., Awaitable[T] | T],
        *args: Any,
        retry: Retry | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> Awaitable[T]:
        """Call `fn(*args, **kwargs)` once and record its result (at least once: a crash before the
        record calls it again). A recorded step returns its recorded result without calling `fn`.
        After `retry.max_attempts` failures it records the error and raises StepFailedError
        (a replay raises it again)."""
        seq = self.next_seq()
        return self._step(seq, name or _name_of(fn), fn, args, kwargs, retry)

    async def _step(
        self,
        seq: int,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retry: Retry | None,
    ) -> Any:
        returns = self.engine.return_type(fn)
        rec = self.recorded(seq, name, "step")
        if rec is not None:
            if rec.error is not None:
                raise StepFailedError(f"step {seq} ({name}) failed: {rec.error}", step=name, error=rec.error)
            return self.engine.decode(rec.output, returns)
        policy = retry.policy() if retry is not None else None
        attempts = policy.max_attempts if policy is not None else 1
        started = datetime.now(UTC)
        attempt = 0
        while True:
            attempt += 1
            try:
                value = fn(*args, **kwargs)
                if inspect.isawaitable(value):
                    value = await value
            except Exception as exc:
                if attempt < attempts:
                    assert policy is not None
                    await asyncio.sleep(policy.delay(attempt))
                    continue
                error = f"{type(exc).__name__}: {exc}"
                await self._record(seq, name, "step", None, error, attempt, started)
                raise StepFailedError(f"step {seq} ({name}) failed: {error}", step=name, error=error) from exc
            output = self.engine.encode(value, f"the result of step {name!r}")
            await self._record(seq, name, "step", output, None, attempt, started)
            return self.engine.decode(output, returns)

    def transaction(self, name: str = "transaction") -> WorkflowTransaction:
        """A step whose writes on `tx.connection` commit in one transaction with its record: exactly once."""
        return WorkflowTransaction(self, name)

    # -- time and waits ----------------------------------------------------------------

    async def _deadline(self, what: str, timeout: float | timedelta | None) -> float | None:  # noqa: ASYNC109 - a recorded deadline
        """The wall-clock deadline of a wait, recorded when first reached (a resumed wait keeps it)."""
        if timeout is None:
            return None
        seconds = _seconds(timeout, "timeout")
        seq = self.next_seq()
        rec = self.recorded(seq, what, "deadline")
        if rec is not None:
            return float(msgspec.json.decode(rec.output or b"0"))
        deadline = time.time() + seconds
        await self._record(seq, what, "deadline", msgspec.json.encode(deadline))
        return deadline

    async def sleep(self, duration: float | timedelta) -> None:
        """A durable timer: the wake-up time is recorded; a long sleep parks the run (no process
        waits) and a delayed job resumes it on any process, within a second of its time."""
        wake_at = await self._deadline("sleep", duration if duration is not None else 0)
        assert wake_at is not None
        remaining = wake_at - time.time()
        if remaining > self.engine.park_after:
            await self.engine.park(self, wake_at)
        if remaining > 0:
            await asyncio.sleep(remaining)

    async def recv(self, topic: str, timeout: float | timedelta | None = None) -> Any:  # noqa: ASYNC109 - the public API's shape
        """The next message `b.send(workflow_id, topic, payload)` sent to this run (oldest first),
        consumed with the step's record; None if `timeout` passes first."""
        validate_name(topic, "recv topic")
        deadline = await self._deadline(f"recv:{topic}", timeout)
        seq = self.next_seq()
        name = f"recv:{topic}"
        rec = self.recorded(seq, name, "recv")
        if rec is not None:
            return self.engine.decode(rec.output, Any)
        engine = self.engine
        with engine.watching(self.workflow_id) as heard:
            while True:
                heard.clear()
                with db.translate_errors():
                    async with engine.ctx.pool.acquire() as conn, conn.transaction():
                        payload = await sql.take_message(conn, self.workflow_id, topic)
                        if payload is not None or (deadline is not None and time.time() >= deadline):
                            output = payload if payload is not None else b"null"
                            await self._record(seq, name, "recv", output, conn=conn)
                            return engine.decode(output, Any)
                await engine.check_held(self)
                await engine.wait_event(heard, deadline)

    async def wait_for(
        self,
        topic: str,
        key: str,
        timeout: float | timedelta | None = None,  # noqa: ASYNC109 - the public API's shape
    ) -> Message | None:
        """The first message of `topic` with `key` published since the run started (and after the one
        an earlier wait_for of this run on the same topic and key returned); None after `timeout`.
        Woken by the topic's NOTIFY: a message published before the wait began counts too."""
        validate_name(topic, "topic name")
        if not isinstance(key, str) or not key:
            raise ValidationError("wait_for needs the message key to wait for (a non-empty str)")
        deadline = await self._deadline(f"wait_for:{topic}", timeout)
        seq = self.next_seq()
        name = f"wait_for:{topic}"
        rec = self.recorded(seq, name, "wait_for")
        engine = self.engine
        if rec is not None:
            found = msgspec.json.decode(rec.output or b"{}", type=_Found)
            self._saw(topic, key, found)
            return found.message
        bell = await engine.topic_bell(topic)
        while True:
            seen = bell.rings
            after = self._seen.get((topic, key), (_EPOCH, 0, -1))
            with db.translate_errors():
                row = await sql.find_message(engine.ctx.pool, topic, key, self.created_at, after)
            if row is not None or (deadline is not None and time.time() >= deadline):
                found = _Found(None)
                if row is not None:
                    found = _Found(
                        Message(
                            topic=topic,
                            partition=row["partition"],
                            offset=row["offset"],
                            key=row["key"],
                            headers=dict(row["headers"] or {}),
                            payload=row["payload"],
                            created_at=row["created_at"],
                        ),
                        row["partition_id"],
                    )
                await self._record(seq, name, "wait_for", msgspec.json.encode(found))
                self._saw(topic, key, found)
                return found.message
            await engine.check_held(self)
            await bell.wait(seen, engine.wait_slice(deadline))

    def _saw(self, topic: str, key: str, found: _Found) -> None:
        if found.message is not None:
            m = found.message
            self._seen[(topic, key)] = (m.created_at, found.partition_id, m.offset)

    # -- other runs ----------------------------------------------------------------

    def child(
        self, name: str, *args: Any, retry: Retry | None = None, version: str | None = None
    ) -> Awaitable[Any]:
        """Start the workflow `name` as a child of this run and wait for its result (fan out with
        asyncio.gather). A failed child is started again up to `retry.max_attempts` times in all;
        then WorkflowFailedError. The child's id is this run's id, '/', the step number."""
        seq = self.next_seq()
        return self._child(seq, name, args, retry, version)

    async def _child(
        self, seq: int, name: str, args: tuple[Any, ...], retry: Retry | None, version: str | None
    ) -> Any:
        step = f"child:{name}"
        engine = self.engine
        returns = engine.result_type(name, version)
        rec = self.recorded(seq, step, "child")
        if rec is not None:
            if rec.error is not None:
                raise WorkflowFailedError(
                    f"child workflow {name!r} of run {self.workflow_id!r} failed: {rec.error}",
                    workflow_id=f"{self.workflow_id}/{seq}",
                    error_type="WorkflowFailedError",
                    error=rec.error,
                )
            return engine.decode(rec.output, returns)
        attempts = retry.policy().max_attempts if retry is not None else 1
        started = datetime.now(UTC)
        error = ""
        for attempt in range(1, attempts + 1):
            child_id = f"{self.workflow_id}/{seq}" if attempt == 1 else f"{self.workflow_id}/{seq}.{attempt}"
            await engine.create(child_id, name, args, version=version, parent_id=self.workflow_id)
            row = await engine.outcome(child_id, held_by=self)
            if row["status"] == "succeeded":
                await self._record(seq, step, "child", row["output"], None, attempt, started)
                return engine.decode(row["output"], returns)
            error = f"{row['error_type'] or row['status']}: {row['error'] or ''} (run {child_id})"
        await self._record(seq, step, "child", None, error, attempts, started)
        raise WorkflowFailedError(
            f"child workflow {name!r} of run {self.workflow_id!r} failed: {error}",
            workflow_id=f"{self.workflow_id}/{seq}",
            error_type="WorkflowFailedError",
            error=error,
        )

    async def send(self, workflow_id: str, topic: str, payload: Any) -> None:
        """Send to another run's `recv(topic)`, exactly once (the message and this step's record
        commit together)."""
        validate_name(topic, "recv topic")
        seq = self.next_seq()
        name = f"send:{topic}"
        if self.recorded(seq, name, "send") is not None:
            return
        engine = self.engine
        data = engine.encode(payload, "a sent message")
        with db.translate_errors():
            async with engine.ctx.pool.acquire() as conn, conn.transaction():
                await sql.send(conn, workflow_id, topic, data, engine.channel)
                await self._record(seq, name, "send", b"null", conn=conn)

    async def set_event(self, key: str, value: Any) -> None:
        """Publish a value under `key` for `b.get_event(workflow_id, key)` (the latest set wins)."""
        if not isinstance(key, str) or not key:
            raise ValidationError("set_event needs a non-empty str key")
        seq = self.next_seq()
        name = f"event:{key}"
        if self.recorded(seq, name, "event") is not None:
            return
        engine = self.engine
        data = engine.encode(value, "an event value")
        with db.translate_errors():
            async with engine.ctx.pool.acquire() as conn, conn.transaction():
                await sql.set_event(conn, self.workflow_id, key, data, engine.channel)
                await self._record(seq, name, "event", b"null", conn=conn)

    # -- compensations -------------------------------------------------------------

    def on_failure(self, fn: Callable[..., Any], *args: Any, name: str | None = None) -> None:
        """If the run fails after this point, call `fn(*args)`: compensations run newest first, each
        as a recorded step (once, even when the failure is replayed)."""
        self._compensations.append((fn, args, name or f"compensate:{_name_of(fn)}"))

    async def compensate(self) -> list[str]:
        """Run the registered compensations, newest first; the errors of those that failed."""
        errors = []
        while self._compensations:
            fn, args, name = self._compensations.pop()
            try:
                await self.step(fn, *args, name=name)
            except StepFailedError as exc:
                errors.append(exc.error)
        return errors
