"""The actor runtime: actors, their refs, bounded mailboxes and one-for-one supervision.

An actor is one asyncio task that owns its state and handles one message at a
time. Others only ever hold an :class:`ActorRef`. A :class:`Supervisor`
restarts a failed child from its factory with exponential backoff, keeps its
mailbox, and escalates to its owner once the child fails too often
(OTP's restart intensity). Each actor's loop is the classic one: start
hook, receive loop, stop hook, failure hook, and a clear "stopped" error for
whatever is still waiting when the actor ends.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import random
import sys
import types
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from actors.time_source import RealTime, TimeSource
from storage.errors import ActorStoppedError
from storage.logs import get_logger

__all__ = [
    "Actor",
    "ActorRef",
    "ActorStoppedError",
    "AskTimeoutError",
    "Backoff",
    "EscalationHandler",
    "Message",
    "RealTime",
    "RestartStrategy",
    "Supervisor",
    "TimeSource",
    "Timer",
    "spawn",
]

# Through the stdlib (never stdout) so an unconfigured service sees only warnings.
_logger = get_logger(__name__)

M = TypeVar("M", bound=msgspec.Struct, contravariant=True)
N = TypeVar("N", bound=msgspec.Struct)
T = TypeVar("T")


class Message(msgspec.Struct, frozen=True, tag=True):
    """Convenience base for actor messages: frozen (safe to share) and tagged (safe to encode).

    Subclass as ``class Ping(Message, frozen=True)``: msgspec inherits
    ``frozen`` at runtime, but mypy rejects a subclass that does not repeat it.
    """


class AskTimeoutError(TimeoutError):
    """An :meth:`ActorRef.ask` got no answer within its timeout."""


EscalationHandler = Callable[[str, BaseException], Awaitable[None] | None]
"""Called with a child's name and its last exception when the supervisor gives up on it."""


class Backoff(msgspec.Struct, frozen=True):
    """Capped exponential backoff with jitter, as data: how often to try again while something is away.

    The n-th attempt in a row waits ``initial * multiplier ** (n - 1)`` seconds,
    capped at ``maximum``, less a random part of up to ``jitter`` of it, so
    the processes that lost the same server do not all come back at once.
    """

    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the ``attempt``-th try in a row (1 for the first retry)."""
        full = min(self.initial * self.multiplier ** max(attempt - 1, 0), self.maximum)
        return full * (1.0 - self.jitter * random.random())  # noqa: S311 - jitter, not a secret


class RestartStrategy(msgspec.Struct, frozen=True):
    """One-for-one restart policy, as data.

    More than ``max_restarts`` failures within ``within`` seconds and the
    supervisor gives up on the child and escalates. The n-th failure inside
    that window waits ``backoff_initial * backoff_multiplier ** (n - 1)``
    seconds (capped at ``backoff_max``) before the restart, so a child that
    fails only now and then always restarts quickly.

    A failure the supervisor's ``outage`` test says is an outage (the
    database is away) is not counted: the child restarts after ``outage``'s
    backoff for as long as the outage lasts, however long.
    """

    max_restarts: int = 3
    within: float = 5.0
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    backoff_multiplier: float = 2.0
    outage: Backoff = Backoff()

    def backoff(self, failures_in_window: int) -> float:
        """Seconds to wait before restarting after the ``failures_in_window``-th recent failure."""
        delay = self.backoff_initial * self.backoff_multiplier ** max(failures_in_window - 1, 0)
        return min(delay, self.backoff_max)


class Actor(abc.ABC, Generic[M]):
    """Base class for actors handling messages of type ``M``.

    Override :meth:`receive` (typically a ``match`` over the message types)
    and, if needed, the lifecycle hooks. All of them run in the actor's own
    task, one at a time, so the instance's attributes need no locking.
    """

    #: Capacity of the bounded mailbox; ``tell`` waits when it is full.
    mailbox_size: ClassVar[int] = 1000

    _ref: ActorRef[M] | None = None

    @property
    def self_ref(self) -> ActorRef[M]:
        """This actor's own ref, e.g. to schedule ticks to itself. Available from ``on_start`` on."""
        if self._ref is None:
            raise RuntimeError(f"{type(self).__name__}.self_ref is only available once the actor is spawned")
        return self._ref

    @property
    def clock(self) -> TimeSource:
        """The time this actor's timers run on: its supervisor's (for a Bus's actors, the Bus's time)."""
        return self.self_ref.clock

    @abc.abstractmethod
    async def receive(self, message: M) -> Any:
        """Handle one message; the return value answers an ``ask``."""

    async def on_start(self) -> None:  # noqa: B027 - optional hook
        """Run before the first message; raising here counts as a failure."""

    async def on_stop(self) -> None:  # noqa: B027 - optional hook
        """Run after the last message of a graceful stop; not called after a failure."""

    async def on_failure(self, exc: BaseException) -> None:  # noqa: B027 - optional hook
        """Run on the failed instance, before it is restarted or stopped for good."""


@dataclass(slots=True)
class _Envelope:
    message: msgspec.Struct
    reply: asyncio.Future[Any] | None  # None for tell: nobody is waiting


def _check_message(message: object) -> None:
    if not (isinstance(message, msgspec.Struct) and type(message).__struct_config__.frozen):
        raise TypeError(
            f"actor messages must be frozen msgspec.Structs (e.g. subclass actors.Message), "
            f"got {type(message).__qualname__}"
        )


class _Mailbox:
    """A bounded FIFO that can be closed; closing wakes everyone waiting on it.

    asyncio.Queue cannot be closed on Python 3.11, and a ``tell`` blocked on a
    full mailbox must fail when the actor stops rather than wait forever.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"mailbox size must be at least 1, got {capacity}")
        self._items: deque[_Envelope] = deque()
        self._capacity = capacity
        self.closed = False
        # Invariants: _readable is set iff items or closed; _writable iff not full or closed.
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, envelope: _Envelope) -> bool:
        if self.closed:
            raise ActorStoppedError("mailbox closed")
        if len(self._items) >= self._capacity:
            return False
        self._items.append(envelope)
        self._readable.set()
        if len(self._items) >= self._capacity:
            self._writable.clear()
        return True

    async def put(self, envelope: _Envelope) -> None:
        while not self.put_nowait(envelope):
            await self._writable.wait()

    async def get(self) -> _Envelope | None:
        """Next envelope, or None once the mailbox is closed and empty."""
        while not self._items:
            if self.closed:
                return None
            await self._readable.wait()
        envelope = self._items.popleft()
        self._writable.set()
        if not self._items and not self.closed:
            self._readable.clear()
        return envelope

    def close(self) -> None:
        self.closed = True
        self._readable.set()
        self._writable.set()

    def take_all(self) -> list[_Envelope]:
        items = list(self._items)
        self._items.clear()
        return items


class Timer:
    """Handle returned by :meth:`ActorRef.schedule_every` and :meth:`ActorRef.schedule_once`."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task

    def cancel(self) -> None:
        """Stop sending; idempotent."""
        self._task.cancel()

    @property
    def active(self) -> bool:
        """True until cancelled (directly or because the actor instance ended)."""
        return not self._task.done()


class _Cell(Generic[N]):
    """Runtime state behind one ActorRef: mailbox, task, and the restart loop.

    ``strategy=None`` means unsupervised: the first failure stops the actor
    and pending asks get the exception itself.
    """

    def __init__(
        self,
        factory: Callable[[], Actor[N]],
        name: str,
        mailbox_size: int | None,
        strategy: RestartStrategy | None,
        on_give_up: Callable[[str, BaseException], None] | None,
        clock: TimeSource,
        outage: Callable[[BaseException], bool] | None = None,
    ) -> None:
        # Build the first instance here so a broken constructor fails the spawn call itself.
        first = factory()
        self.name = name
        self.factory = factory
        self.mailbox = _Mailbox(mailbox_size if mailbox_size is not None else first.mailbox_size)
        self.strategy = strategy
        self.on_give_up = on_give_up
        self.clock = clock
        self.log = _logger.bind(actor=name)
        self.ref: ActorRef[N] = ActorRef(self)
        self.timers: set[Timer] = set()
        self.stop_requested = asyncio.Event()
        self.recent_failures: deque[float] = deque()
        self.outage = outage
        self.outage_failures = 0  # outage failures in a row (reset by a message handled)
        self.task = asyncio.get_running_loop().create_task(self._run(first), name=f"actor:{name}")

    async def _run(self, actor: Actor[N]) -> None:
        error_for_pending: BaseException | None = None
        try:
            while True:
                exc = await self._live(actor)
                if exc is None:
                    return
                if self.strategy is None:
                    self.log.error("actor.failed_unsupervised", exc_info=exc)
                    error_for_pending = exc
                    return
                outage = self.outage is not None and self.outage(exc)
                delay = self._outage_backoff(exc) if outage else self._backoff(exc)
                if delay is None:  # given up
                    return
                if await self._stopped_during(delay):
                    # No instance is left to drain with, so whatever is queued is dropped.
                    return
                try:
                    actor = self.factory()
                except Exception as factory_exc:
                    self.log.error("actor.factory_failed", exc_info=factory_exc)
                    actor = _FailingActor(factory_exc)
        finally:
            # Whatever ended the task (stop, give-up, cancellation), no ask may hang.
            self._close_and_fail_pending(error=error_for_pending)

    def _outage_backoff(self, exc: BaseException) -> float:
        """The wait before restarting a child that failed because the database is away: never a give-up.

        The first failure of an outage is logged as a restart (without its traceback), the
        others quietly: the Bus says once that the database is unavailable, and once that it is back.
        """
        assert self.strategy is not None
        self.outage_failures += 1
        delay = self.strategy.outage.delay(self.outage_failures)
        log = self.log.warning if self.outage_failures == 1 else self.log.debug
        log("actor.restarting", backoff=round(delay, 3), outage=True, error=repr(exc))
        return delay

    def _backoff(self, exc: BaseException) -> float | None:
        """The wait before restarting a child that failed; None once it failed too often (given up)."""
        assert self.strategy is not None
        now = self.clock.monotonic()
        self.recent_failures.append(now)
        while self.recent_failures and self.recent_failures[0] < now - self.strategy.within:
            self.recent_failures.popleft()
        if len(self.recent_failures) > self.strategy.max_restarts:
            self.log.error(
                "actor.gave_up",
                failures=len(self.recent_failures),
                within=self.strategy.within,
                exc_info=exc,
            )
            self._close_and_fail_pending(cause=exc)
            if self.on_give_up is not None:
                self.on_give_up(self.name, exc)
            return None
        delay = self.strategy.backoff(len(self.recent_failures))
        self.log.warning("actor.restarting", backoff=delay, exc_info=exc)
        return delay

    async def _live(self, actor: Actor[N]) -> BaseException | None:
        """Run one instance until a graceful stop (None) or its failure (the exception)."""
        actor._ref = self.ref
        try:
            try:
                await actor.on_start()
            except Exception as exc:
                return await self._failed(actor, exc)
            while (envelope := await self.mailbox.get()) is not None:
                try:
                    result = await actor.receive(envelope.message)  # type: ignore[arg-type]
                except Exception as exc:
                    if envelope.reply is not None and not envelope.reply.done():
                        envelope.reply.set_exception(exc)
                    return await self._failed(actor, exc)
                if envelope.reply is not None and not envelope.reply.done():
                    envelope.reply.set_result(result)
                self.outage_failures = 0  # it works again: the next outage starts its backoff over
            try:
                await actor.on_stop()
            except Exception:
                self.log.exception("actor.on_stop_failed")
            self.log.debug("actor.stopped")
            return None
        finally:
            # Timers belong to the instance: a restarted one re-creates them in on_start.
            for timer in list(self.timers):
                timer.cancel()
            self.timers.clear()

    async def _failed(self, actor: Actor[N], exc: Exception) -> Exception:
        # Only the first failure of an outage is worth a warning: the others are the same news.
        quiet = self.outage_failures > 0 and self.outage is not None and self.outage(exc)
        (self.log.debug if quiet else self.log.warning)("actor.failed", error=repr(exc))
        try:
            await actor.on_failure(exc)
        except Exception:
            self.log.exception("actor.on_failure_failed")
        return exc

    async def _stopped_during(self, delay: float) -> bool:
        sleeper = asyncio.ensure_future(self.clock.sleep(delay))
        stopper = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            stopper.cancel()
        return self.stop_requested.is_set()

    def request_stop(self, drain: bool) -> None:
        self.stop_requested.set()
        self.mailbox.close()
        if not drain:
            self._fail_pending(self.mailbox.take_all(), error=None)

    def _close_and_fail_pending(
        self, *, error: BaseException | None = None, cause: BaseException | None = None
    ) -> None:
        self.mailbox.close()
        self._fail_pending(self.mailbox.take_all(), error=error, cause=cause)

    def _fail_pending(
        self, envelopes: list[_Envelope], *, error: BaseException | None, cause: BaseException | None = None
    ) -> None:
        for envelope in envelopes:
            if envelope.reply is None or envelope.reply.done():
                continue
            if error is not None:
                envelope.reply.set_exception(error)
                continue
            stopped = ActorStoppedError(
                f"actor {self.name} stopped before handling {type(envelope.message).__name__}"
            )
            stopped.__cause__ = cause
            envelope.reply.set_exception(stopped)


class _FailingActor(Actor[Any]):
    """Stands in when the factory itself raises on restart, so that counts as a failure too."""

    def __init__(self, exc: Exception) -> None:
        self._exc = exc

    async def on_start(self) -> None:
        raise self._exc

    async def receive(self, message: Any) -> Any:
        raise self._exc


class ActorRef(Generic[M]):
    """The only handle to an actor: send it messages, ask it questions, stop it.

    Stays valid across supervised restarts; the mailbox behind it is the same.
    """

    def __init__(self, cell: _Cell[Any]) -> None:
        self._cell = cell

    def __repr__(self) -> str:
        return f"<ActorRef {self.name} {'alive' if self.is_alive else 'stopped'}>"

    @property
    def name(self) -> str:
        """The name the actor was spawned with."""
        return self._cell.name

    @property
    def queued(self) -> int:
        """Messages waiting in the mailbox (for an actor that batches: is more of a burst still coming?)."""
        return len(self._cell.mailbox)

    @property
    def is_alive(self) -> bool:
        """True until the actor's task has ended."""
        return not self._cell.task.done()

    @property
    def clock(self) -> TimeSource:
        """The time the actor's timers run on (given to `spawn` or its supervisor)."""
        return self._cell.clock

    def _stopped_error(self, message: msgspec.Struct) -> ActorStoppedError:
        return ActorStoppedError(
            f"actor {self.name} is stopped and accepts no more messages (got {type(message).__name__}): "
            "it was stopped, or failed for good (the log says why: actor.gave_up). If it belongs to a Bus, "
            "b.health() names what failed: close the Bus and connect again"
        )

    async def tell(self, message: M) -> None:
        """Enqueue ``message``; waits while the mailbox is full (backpressure)."""
        _check_message(message)
        try:
            await self._cell.mailbox.put(_Envelope(message, None))
        except ActorStoppedError:
            raise self._stopped_error(message) from None

    def try_tell(self, message: M) -> bool:
        """Enqueue ``message`` if there is room right now; False when the mailbox is full."""
        _check_message(message)
        try:
            return self._cell.mailbox.put_nowait(_Envelope(message, None))
        except ActorStoppedError:
            raise self._stopped_error(message) from None

    def signal(self, message: M) -> bool:
        """Best-effort, never raises: enqueue if there is room and the actor lives, else drop.

        For hints whose loss a timer covers (wake-ups, NOTIFY fan-out,
        unsubscribes during shutdown).
        """
        try:
            return self.try_tell(message)
        except ActorStoppedError:
            return False

    async def ask(self, message: M, timeout: float | None = 5.0) -> Any:  # noqa: ASYNC109 - an ask without a deadline is a hang waiting to happen
        """Send ``message`` and return what ``receive`` returned.

        Raises what ``receive`` raised, :class:`AskTimeoutError` when no answer
        (including the wait for mailbox room) comes within ``timeout`` seconds,
        and :class:`ActorStoppedError` when the actor stops first.
        """
        _check_message(message)
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                try:
                    await self._cell.mailbox.put(_Envelope(message, reply))
                except ActorStoppedError:
                    raise self._stopped_error(message) from None
                return await reply
        except TimeoutError:
            # receive() may itself raise a TimeoutError; only our own deadline is an ask timeout.
            if deadline.expired():
                raise AskTimeoutError(
                    f"actor {self.name} did not answer {type(message).__name__} within {timeout}s"
                ) from None
            raise

    async def stop(self, drain: bool = True) -> None:
        """Stop gracefully and wait for the actor to end; idempotent.

        ``drain=True`` handles what is already queued first; ``drain=False``
        drops it and fails those asks with :class:`ActorStoppedError`. Either
        way the message in hand is finished and ``on_stop`` runs. Called from
        the actor itself, it only requests the stop (waiting would deadlock).
        """
        self._cell.request_stop(drain)
        if asyncio.current_task() is not self._cell.task:
            await self.join()

    def request_stop(self, drain: bool = False) -> None:
        """Ask the actor to stop and return at once (the message in hand is finished first).

        For an owner that must not wait on it (e.g. one that has to keep
        beating while the stopping actor waits on the database); `join()`
        waits for the end.
        """
        self._cell.request_stop(drain)

    async def join(self) -> None:
        """Wait until the actor's task has ended, for whatever reason."""
        await asyncio.wait({self._cell.task})

    def schedule_every(self, interval: float, message: M) -> Timer:
        """Send ``message`` to this actor every ``interval`` seconds until cancelled.

        Ticks are ``try_tell``: when the mailbox is full the tick is skipped,
        because a periodic wake-up is worthless once it is late. The timer is
        cancelled when the current actor instance stops or fails, so schedule
        from ``on_start`` to survive restarts.
        """
        _check_message(message)
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        cell = self._cell

        async def tick() -> None:
            while True:
                await cell.clock.sleep(interval)
                if cell.mailbox.closed:
                    return
                if not cell.mailbox.put_nowait(_Envelope(message, None)):
                    cell.log.debug("actor.tick_skipped", message=type(message).__name__)

        timer = Timer(asyncio.get_running_loop().create_task(tick(), name=f"timer:{cell.name}"))
        cell.timers.add(timer)
        return timer

    def schedule_once(self, delay: float, message: M) -> Timer:
        """Send ``message`` to this actor once, ``delay`` seconds from now (on the actor's clock).

        Like :meth:`schedule_every`, the timer belongs to the current actor
        instance: it is cancelled when that instance stops, fails or restarts,
        so nothing scheduled by an instance reaches its successor. The message
        waits for mailbox room (it is not a skippable tick).
        """
        _check_message(message)
        if delay < 0:
            raise ValueError(f"delay must not be negative, got {delay}")
        cell = self._cell

        async def fire() -> None:
            await cell.clock.sleep(delay)
            if cell.mailbox.closed:
                return
            try:
                await cell.mailbox.put(_Envelope(message, None))
            except ActorStoppedError:
                return

        timer = Timer(asyncio.get_running_loop().create_task(fire(), name=f"timer-once:{cell.name}"))
        cell.timers.add(timer)
        timer._task.add_done_callback(lambda _t: cell.timers.discard(timer))
        return timer


def spawn(
    factory: Callable[[], Actor[N]],
    name: str,
    mailbox_size: int | None = None,
    clock: TimeSource | None = None,
) -> ActorRef[N]:
    """Start an unsupervised actor in the running event loop.

    A failure stops it for good: ``on_failure`` runs, and every pending ask
    fails with the exception.
    """
    cell = _Cell(factory, name, mailbox_size, None, None, clock or RealTime())
    return cell.ref


class Supervisor:
    """Owns child actors and restarts each one alone when it fails (one-for-one).

    When a child fails more often than its :class:`RestartStrategy` allows,
    it is stopped for good, the failure is recorded in :attr:`failures`,
    :attr:`escalated` is set, and ``on_escalate(child_name, exc)`` is called.
    Pass a parent supervisor's :meth:`escalate` as ``on_escalate`` to nest.

    ``outage(exc)`` tells an outage (a server that is away, not a bug) from
    other failures: a child that fails of one restarts after the strategy's
    ``outage`` backoff for as long as it lasts, and such failures never
    count toward the restart intensity.
    """

    def __init__(
        self,
        name: str = "supervisor",
        *,
        on_escalate: EscalationHandler | None = None,
        strategy: RestartStrategy | None = None,
        clock: TimeSource | None = None,
        outage: Callable[[BaseException], bool] | None = None,
    ) -> None:
        self.name = name
        self.strategy = strategy or RestartStrategy()
        self.outage = outage
        self.escalated = asyncio.Event()
        self._on_escalate = on_escalate
        self._clock = clock or RealTime()
        self._children: dict[str, ActorRef[Any]] = {}
        self._failures: list[tuple[str, BaseException]] = []
        self._escalations: set[asyncio.Task[None]] = set()
        self._stopped = False
        self._log = _logger.bind(supervisor=name)

    @property
    def children(self) -> Mapping[str, ActorRef[Any]]:
        """Live view of the children by name, in spawn order."""
        return MappingProxyType(self._children)

    @property
    def failures(self) -> tuple[tuple[str, BaseException], ...]:
        """Every escalated failure so far, as ``(child_name, exception)``."""
        return tuple(self._failures)

    def spawn(
        self,
        factory: Callable[[], Actor[N]],
        name: str,
        mailbox_size: int | None = None,
        strategy: RestartStrategy | None = None,
    ) -> ActorRef[N]:
        """Start a child; ``strategy`` overrides the supervisor's default for this child."""
        if self._stopped:
            raise ActorStoppedError(f"supervisor {self.name} is stopped; cannot spawn {name}")
        if name in self._children:
            raise ValueError(f"supervisor {self.name} already has a child named {name!r}")
        cell = _Cell(
            factory, name, mailbox_size, strategy or self.strategy, self._give_up, self._clock, self.outage
        )
        self._children[name] = cell.ref
        cell.task.add_done_callback(lambda _: self._forget(name, cell.ref))
        return cell.ref

    def _forget(self, name: str, ref: ActorRef[Any]) -> None:
        if self._children.get(name) is ref:
            del self._children[name]

    def _give_up(self, child: str, exc: BaseException) -> None:
        # Runs in its own task: a handler that stops this supervisor must not wait on the dying child.
        task = asyncio.get_running_loop().create_task(self.escalate(child, exc))
        self._escalations.add(task)
        task.add_done_callback(self._escalations.discard)

    async def escalate(self, child: str, exc: BaseException) -> None:
        """Record ``child``'s fatal failure and pass it to this supervisor's owner."""
        self._failures.append((child, exc))
        self.escalated.set()
        self._log.error("supervisor.escalating", child=child, error=repr(exc))
        if self._on_escalate is None:
            return
        try:
            outcome = self._on_escalate(child, exc)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            self._log.exception("supervisor.on_escalate_failed", child=child)

    async def stop(self) -> None:
        """Stop all children gracefully, newest first; idempotent."""
        self._stopped = True
        for ref in reversed(list(self._children.values())):
            await ref.stop(drain=True)


def start_eagerly(coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Future[T]:
    """A task whose coroutine runs at once, in the caller's turn, up to its first real wait.

    A task made by `create_task` takes its first step on the event loop's next
    turn: a statement it writes leaves one turn later than it could. This is Python 3.12's eager start (`eager_start=True`), with a
    backport for 3.11: the coroutine is stepped here, and a task resumes it
    from the future it waits on. Under the backport the coroutine runs as part
    of the caller until that first wait (`asyncio.current_task()` is the
    caller's), so it must not start a timeout or a task group before it; and it
    may even finish there (what is returned is then a future done already).
    """
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, name=name, eager_start=True)
    try:
        waiting = coro.send(None)
    except StopIteration as stop:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(stop.value)
        return done
    except asyncio.CancelledError:
        done = loop.create_future()
        done.cancel()
        return done
    except BaseException as exc:  # raised before its first wait: the future carries it, as a task would
        done = loop.create_future()
        done.set_exception(exc)
        return done
    task = loop.create_task(_resumed(coro, waiting), name=name)
    task.add_done_callback(lambda _task: _settle(coro))
    return task


@types.coroutine
def _resumed(coro: Coroutine[Any, Any, T], waiting: Any) -> Generator[Any, None, T]:
    """Drive a started coroutine inside a task: hand the task what it waits on, pass back what comes."""
    while True:
        try:
            yield waiting
        except BaseException as exc:  # thrown in by the task (cancellation): the coroutine gets it
            try:
                waiting = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            continue
        try:
            waiting = coro.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def _settle(coro: Coroutine[Any, Any, Any]) -> None:
    """A task cancelled before its first step never resumed the coroutine: cancel it now, so it cleans up."""
    if inspect.getcoroutinestate(coro) != inspect.CORO_SUSPENDED:
        return
    try:
        coro.throw(asyncio.CancelledError())
    except BaseException:  # noqa: S110 - it ended, as it should
        return
    coro.close()  # it went on waiting: nothing will resume it
