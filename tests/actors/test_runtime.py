"""Behaviour of the actor runtime: mailboxes, ask/tell, lifecycle, supervision, timers."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import msgspec
import pytest

import bus
from actors import (
    Actor,
    ActorRef,
    ActorStoppedError,
    AskTimeoutError,
    Message,
    RestartStrategy,
    Supervisor,
    spawn,
)
from actors.runtime import Backoff
from storage.availability import is_unavailable
from storage.errors import StorageUnavailableError

# --- messages ---------------------------------------------------------------


class Note(Message, frozen=True):
    value: int


class Echo(Message, frozen=True):
    value: int


class Block(Message, frozen=True):
    """Parks the actor on its gate until the test opens it."""


class Boom(Message, frozen=True):
    reason: str = "boom"


class Tick(Message, frozen=True):
    pass


class Mutable(msgspec.Struct, tag=True):
    value: int


Msg = Note | Echo | Block | Boom | Tick


class Recorder(Actor[Msg]):
    """Records what happens to it in a shared journal, so restarts stay observable."""

    def __init__(
        self,
        journal: list[Any] | None = None,
        gate: asyncio.Event | None = None,
        blocked: asyncio.Event | None = None,
        fail_on_start: int = 0,
    ) -> None:
        self.journal = journal if journal is not None else []
        self.gate = gate
        self.blocked = blocked
        self.fail_on_start = fail_on_start

    async def on_start(self) -> None:
        self.journal.append(("start", id(self)))
        if self.fail_on_start:
            raise RuntimeError("cannot start")

    async def on_stop(self) -> None:
        self.journal.append(("stop", id(self)))

    async def on_failure(self, exc: BaseException) -> None:
        self.journal.append(("failure", id(self), exc))

    async def receive(self, message: Msg) -> Any:
        match message:
            case Note(value=value):
                self.journal.append(value)
                return None
            case Echo(value=value):
                self.journal.append(value)
                return value * 2
            case Block():
                if self.blocked is not None:
                    self.blocked.set()
                assert self.gate is not None
                await self.gate.wait()
                return "unblocked"
            case Boom(reason=reason):
                raise ValueError(reason)
            case Tick():
                self.journal.append("tick")
                return None


class FakeClock:
    """Time that only moves when the runtime sleeps; records every sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def numbers(journal: list[Any]) -> list[int]:
    return [entry for entry in journal if isinstance(entry, int)]


def events(journal: list[Any]) -> list[str]:
    return [entry[0] if isinstance(entry, tuple) else "msg" for entry in journal]


async def block(ref: ActorRef[Msg], blocked: asyncio.Event) -> None:
    """Park the actor inside receive(Block), so the test controls when it consumes."""
    await ref.tell(Block())
    await blocked.wait()


# --- mailbox and messaging --------------------------------------------------


async def test_messages_are_handled_in_the_order_they_were_sent() -> None:
    journal: list[Any] = []
    ref = spawn(lambda: Recorder(journal), name="order")
    for i in range(50):
        await ref.tell(Note(i))
    await ref.stop()
    assert numbers(journal) == list(range(50))


async def test_full_mailbox_blocks_tell_until_the_actor_consumes() -> None:
    journal: list[Any] = []
    gate, blocked = asyncio.Event(), asyncio.Event()
    ref = spawn(lambda: Recorder(journal, gate, blocked), name="bounded", mailbox_size=2)
    await block(ref, blocked)
    await ref.tell(Note(1))
    await ref.tell(Note(2))
    assert ref.try_tell(Note(99)) is False

    third = asyncio.create_task(ref.tell(Note(3)))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not third.done(), "tell must wait while the mailbox is full"

    gate.set()
    await asyncio.wait_for(third, 1.0)
    await ref.stop()
    assert numbers(journal) == [1, 2, 3]


async def test_mailbox_size_defaults_to_the_actor_class_attribute() -> None:
    class TinyRecorder(Recorder):
        mailbox_size = 1

    gate, blocked = asyncio.Event(), asyncio.Event()
    ref = spawn(lambda: TinyRecorder(gate=gate, blocked=blocked), name="class-size")
    await block(ref, blocked)
    assert ref.try_tell(Note(1)) is True
    assert ref.try_tell(Note(2)) is False
    gate.set()
    await ref.stop()


async def test_ask_returns_what_receive_returned() -> None:
    ref = spawn(lambda: Recorder(), name="asker")
    assert await ref.ask(Echo(21)) == 42
    await ref.stop()


async def test_ask_raises_ask_timeout_error_when_no_answer_comes_in_time() -> None:
    gate, blocked = asyncio.Event(), asyncio.Event()
    ref = spawn(lambda: Recorder(gate=gate, blocked=blocked), name="slow")
    await block(ref, blocked)
    with pytest.raises(AskTimeoutError, match="slow did not answer Echo") as caught:
        await ref.ask(Echo(1), timeout=0.05)
    assert isinstance(caught.value, TimeoutError)
    gate.set()
    # The late answer lands on an abandoned future; the actor must carry on regardless.
    assert await ref.ask(Echo(2)) == 4
    await ref.stop()


async def test_timeout_raised_inside_receive_is_not_mistaken_for_an_ask_timeout() -> None:
    class TimesOut(Actor[Note]):
        async def receive(self, message: Note) -> None:
            raise TimeoutError("database did not answer")

    ref = spawn(TimesOut, name="db-client")
    with pytest.raises(TimeoutError, match="database did not answer") as caught:
        await ref.ask(Note(1))
    assert not isinstance(caught.value, AskTimeoutError)


async def test_ask_raises_the_exception_receive_raised() -> None:
    ref = spawn(lambda: Recorder(), name="raiser")
    with pytest.raises(ValueError, match="bad input"):
        await ref.ask(Boom("bad input"))


async def test_non_frozen_message_is_rejected() -> None:
    ref = spawn(lambda: Recorder(), name="strict")
    with pytest.raises(TypeError, match="frozen msgspec.Structs"):
        await ref.tell(Mutable(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="frozen msgspec.Structs"):
        await ref.ask({"value": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ref.try_tell(Mutable(1))  # type: ignore[arg-type]
    await ref.stop()


# --- lifecycle and stopping -------------------------------------------------


async def test_on_start_runs_before_the_first_message_and_on_stop_after_the_last() -> None:
    journal: list[Any] = []
    ref = spawn(lambda: Recorder(journal), name="hooks")
    await ref.tell(Note(1))
    await ref.tell(Note(2))
    await ref.stop(drain=True)
    assert events(journal) == ["start", "msg", "msg", "stop"]
    assert not ref.is_alive


async def test_drain_stop_handles_queued_messages_and_asks_first() -> None:
    journal: list[Any] = []
    gate, blocked = asyncio.Event(), asyncio.Event()
    ref = spawn(lambda: Recorder(journal, gate, blocked), name="drainer")
    await block(ref, blocked)
    await ref.tell(Note(1))
    pending = asyncio.create_task(ref.ask(Echo(5)))
    await asyncio.sleep(0)
    stopping = asyncio.create_task(ref.stop(drain=True))
    await asyncio.sleep(0)
    gate.set()
    await stopping
    assert await pending == 10
    assert numbers(journal) == [1, 5]
    assert events(journal)[-1] == "stop"


async def test_stop_without_drain_drops_queued_messages_and_fails_pending_asks() -> None:
    journal: list[Any] = []
    gate, blocked = asyncio.Event(), asyncio.Event()
    ref = spawn(lambda: Recorder(journal, gate, blocked), name="dropper")
    await block(ref, blocked)
    await ref.tell(Note(1))
    pending = asyncio.create_task(ref.ask(Echo(5)))
    await asyncio.sleep(0)
    stopping = asyncio.create_task(ref.stop(drain=False))
    with pytest.raises(ActorStoppedError, match="^actor dropper stopped before handling Echo$"):
        await pending
    gate.set()  # the message in hand is still finished, then on_stop runs
    await stopping
    assert numbers(journal) == []
    assert events(journal)[-1] == "stop"


async def test_tell_blocked_on_a_full_mailbox_fails_when_the_actor_stops() -> None:
    gate, blocked = asyncio.Event(), asyncio.Event()
    ref = spawn(lambda: Recorder(gate=gate, blocked=blocked), name="full", mailbox_size=1)
    await block(ref, blocked)
    await ref.tell(Note(1))
    waiting = asyncio.create_task(ref.tell(Note(2)))
    await asyncio.sleep(0)
    stopping = asyncio.create_task(ref.stop(drain=False))
    with pytest.raises(ActorStoppedError):
        await waiting
    gate.set()
    await stopping


async def test_tell_and_ask_after_stop_raise_actor_stopped_error() -> None:
    ref = spawn(lambda: Recorder(), name="gone")
    await ref.stop()
    await ref.stop()  # idempotent
    with pytest.raises(ActorStoppedError, match="actor gone is stopped"):
        await ref.tell(Note(1))
    with pytest.raises(ActorStoppedError, match="actor gone is stopped"):
        await ref.ask(Echo(1))
    with pytest.raises(ActorStoppedError):
        ref.try_tell(Note(1))


async def test_unsupervised_actor_that_fails_stops_and_fails_pending_asks_with_the_exception() -> None:
    journal: list[Any] = []
    gate, blocked = asyncio.Event(), asyncio.Event()
    ref = spawn(lambda: Recorder(journal, gate, blocked), name="lonely")
    await block(ref, blocked)
    await ref.tell(Boom("fatal"))
    pending = asyncio.create_task(ref.ask(Echo(1)))
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(ValueError, match="fatal"):
        await pending
    await ref.join()
    assert not ref.is_alive
    assert events(journal) == ["start", "failure"]


async def test_actor_can_stop_itself_without_deadlocking() -> None:
    class StopsItself(Actor[Note]):
        async def receive(self, message: Note) -> None:
            await self.self_ref.stop()

    ref = spawn(StopsItself, name="quitter")
    await ref.tell(Note(1))
    await asyncio.wait_for(ref.join(), 1.0)


# --- supervision ------------------------------------------------------------


async def test_one_for_one_restart_keeps_the_mailbox_and_leaves_siblings_alone() -> None:
    clock = FakeClock()
    failing_journal: list[Any] = []
    sibling_journal: list[Any] = []
    gate, blocked = asyncio.Event(), asyncio.Event()
    sup = Supervisor(clock=clock)
    child = sup.spawn(lambda: Recorder(failing_journal, gate, blocked), name="child")
    sibling = sup.spawn(lambda: Recorder(sibling_journal), name="sibling")

    await block(child, blocked)
    await child.tell(Boom())
    await child.tell(Note(1))
    await child.tell(Note(2))
    gate.set()
    assert await child.ask(Echo(3)) == 6

    assert numbers(failing_journal) == [1, 2, 3], (
        "messages queued behind the failure are kept, Boom not retried"
    )
    starts = [entry[1] for entry in failing_journal if isinstance(entry, tuple) and entry[0] == "start"]
    assert len(starts) == 2 and starts[0] != starts[1], "a fresh instance comes from the factory"
    failure = next(entry for entry in failing_journal if isinstance(entry, tuple) and entry[0] == "failure")
    assert failure[1] == starts[0], "on_failure runs on the instance that failed"
    assert isinstance(failure[2], ValueError)

    assert events(sibling_journal) == ["start"]
    assert sibling.is_alive and child.is_alive
    assert sup.children == {"child": child, "sibling": sibling}
    await sup.stop()


async def test_failure_in_on_start_is_restarted_too() -> None:
    clock = FakeClock()
    journal: list[Any] = []
    attempts = iter([1, 0])
    sup = Supervisor(clock=clock)
    ref = sup.spawn(lambda: Recorder(journal, fail_on_start=next(attempts)), name="late-starter")
    assert await ref.ask(Echo(1)) == 2
    assert events(journal)[:3] == ["start", "failure", "start"]
    await sup.stop()


async def test_restart_backoff_grows_exponentially_up_to_the_cap() -> None:
    clock = FakeClock()
    strategy = RestartStrategy(
        max_restarts=10, within=100.0, backoff_initial=0.05, backoff_multiplier=2.0, backoff_max=0.3
    )
    sup = Supervisor(clock=clock, strategy=strategy)
    ref = sup.spawn(lambda: Recorder(), name="flaky")
    for _ in range(5):
        await ref.tell(Boom())
    assert await ref.ask(Echo(1)) == 2
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.3, 0.3])
    await sup.stop()


async def test_too_many_failures_escalate_once_with_child_name_and_exception() -> None:
    clock = FakeClock()
    escalations: list[tuple[str, BaseException]] = []

    async def on_escalate(name: str, exc: BaseException) -> None:
        escalations.append((name, exc))

    sup = Supervisor(
        on_escalate=on_escalate, clock=clock, strategy=RestartStrategy(max_restarts=2, within=10.0)
    )
    ref = sup.spawn(lambda: Recorder(), name="doomed")
    sibling = sup.spawn(lambda: Recorder(), name="survivor")
    for i in range(3):
        await ref.tell(Boom(f"failure {i}"))
    pending = asyncio.create_task(ref.ask(Echo(1)))

    with pytest.raises(ActorStoppedError, match="actor doomed stopped before handling Echo") as caught:
        await pending
    assert isinstance(caught.value.__cause__, ValueError)
    await asyncio.wait_for(sup.escalated.wait(), 1.0)
    await ref.join()
    for _ in range(5):
        await asyncio.sleep(0)

    assert [(name, str(exc)) for name, exc in escalations] == [("doomed", "failure 2")]
    assert sup.failures == tuple(escalations)
    assert len(clock.sleeps) == 2, "two restarts allowed, the third failure gives up"
    assert not ref.is_alive
    assert sibling.is_alive
    assert "doomed" not in sup.children
    with pytest.raises(ActorStoppedError):
        await ref.tell(Note(1))
    await sup.stop()


async def test_failures_spread_out_in_time_do_not_add_up_to_an_escalation() -> None:
    clock = FakeClock()
    sup = Supervisor(clock=clock, strategy=RestartStrategy(max_restarts=1, within=1.0))
    ref = sup.spawn(lambda: Recorder(), name="occasional")
    for _ in range(3):
        await ref.tell(Boom())
        assert await ref.ask(Echo(1)) == 2
        clock.now += 10.0
    assert not sup.escalated.is_set()
    assert clock.sleeps == [0.05, 0.05, 0.05], "backoff starts over once old failures leave the window"
    await sup.stop()


async def test_nested_supervisor_forwards_escalation_to_its_parent() -> None:
    clock = FakeClock()
    parent = Supervisor("parent", clock=clock)
    child_sup = Supervisor(
        "child-sup", on_escalate=parent.escalate, clock=clock, strategy=RestartStrategy(max_restarts=0)
    )
    ref = child_sup.spawn(lambda: Recorder(), name="worker")
    await ref.tell(Boom("deep"))
    await asyncio.wait_for(parent.escalated.wait(), 1.0)
    assert [(name, str(exc)) for name, exc in parent.failures] == [("worker", "deep")]
    await child_sup.stop()
    await parent.stop()


async def test_escalation_handler_may_stop_the_supervisor() -> None:
    clock = FakeClock()
    stopped = asyncio.Event()

    async def on_escalate(name: str, exc: BaseException) -> None:
        await sup.stop()
        stopped.set()

    sup = Supervisor(on_escalate=on_escalate, clock=clock, strategy=RestartStrategy(max_restarts=0))
    ref = sup.spawn(lambda: Recorder(), name="trigger")
    other = sup.spawn(lambda: Recorder(), name="bystander")
    await ref.tell(Boom())
    await asyncio.wait_for(stopped.wait(), 1.0)
    assert not other.is_alive


async def test_supervisor_stop_stops_every_child_newest_first_and_is_idempotent() -> None:
    order: list[str] = []

    class Named(Actor[Note]):
        def __init__(self, name: str) -> None:
            self.name = name

        async def receive(self, message: Note) -> None:
            return None

        async def on_stop(self) -> None:
            order.append(self.name)

    sup = Supervisor()
    refs = [sup.spawn(functools.partial(Named, n), name=n) for n in ("a", "b", "c")]
    await sup.stop()
    await sup.stop()
    assert order == ["c", "b", "a"]
    assert not any(ref.is_alive for ref in refs)
    assert dict(sup.children) == {}
    with pytest.raises(ActorStoppedError):
        sup.spawn(lambda: Named("late"), name="late")


async def test_child_names_are_unique_within_a_supervisor() -> None:
    sup = Supervisor()
    sup.spawn(lambda: Recorder(), name="same")
    with pytest.raises(ValueError, match="already has a child named 'same'"):
        sup.spawn(lambda: Recorder(), name="same")
    await sup.stop()


async def test_supervisor_stop_interrupts_a_restart_backoff() -> None:
    class NeverWakes(FakeClock):
        asleep = asyncio.Event()

        async def sleep(self, seconds: float) -> None:
            self.asleep.set()
            await asyncio.Event().wait()

    clock = NeverWakes()
    sup = Supervisor(clock=clock)
    ref = sup.spawn(lambda: Recorder(), name="resting")
    await ref.tell(Boom())
    pending = asyncio.create_task(ref.ask(Echo(1)))
    await asyncio.wait_for(clock.asleep.wait(), 1.0)
    await asyncio.wait_for(sup.stop(), 1.0)
    with pytest.raises(ActorStoppedError):
        await pending


# --- timers -----------------------------------------------------------------


async def test_schedule_every_delivers_ticks_until_the_actor_stops() -> None:
    three_ticks = asyncio.Event()
    ticks: list[int] = []
    timers = []

    class Ticker(Actor[Tick]):
        async def on_start(self) -> None:
            timers.append(self.self_ref.schedule_every(0.005, Tick()))

        async def receive(self, message: Tick) -> None:
            ticks.append(1)
            if len(ticks) == 3:
                three_ticks.set()

    ref = spawn(Ticker, name="ticker")
    await asyncio.wait_for(three_ticks.wait(), 2.0)
    assert timers[0].active
    await ref.stop()
    assert not timers[0].active
    seen = len(ticks)
    await asyncio.sleep(0.03)
    assert len(ticks) == seen


async def test_scheduled_timer_can_be_cancelled() -> None:
    ref = spawn(lambda: Recorder(), name="cancel-timer")
    timer = ref.schedule_every(10.0, Tick())
    timer.cancel()
    await asyncio.sleep(0)
    assert not timer.active
    await ref.stop()


async def test_schedule_once_follows_the_injected_clock_and_fires_once() -> None:
    clock = FakeClock()
    journal: list[Any] = []
    ref = spawn(lambda: Recorder(journal), name="once", clock=clock)
    timer = ref.schedule_once(42.0, Tick())
    for _ in range(20):
        await asyncio.sleep(0)
    assert journal.count("tick") == 1
    assert 42.0 in clock.sleeps
    assert not timer.active
    await ref.stop()


async def test_schedule_once_is_cancelled_when_the_actor_instance_stops() -> None:
    journal: list[Any] = []
    ref = spawn(lambda: Recorder(journal), name="once-stop")
    timer = ref.schedule_once(0.05, Tick())
    await ref.stop()
    assert not timer.active
    await asyncio.sleep(0.1)
    assert "tick" not in journal


async def test_schedule_once_of_a_failed_instance_never_reaches_its_successor() -> None:
    journal: list[Any] = []
    sup = Supervisor("once-sup", strategy=RestartStrategy(max_restarts=3, within=5.0, backoff_initial=0.0))
    ref = sup.spawn(lambda: Recorder(journal), "child")
    timer = ref.schedule_once(0.1, Tick())
    await ref.tell(Boom())
    await asyncio.sleep(0.2)
    assert not timer.active
    assert "tick" not in journal
    await sup.stop()


# --- outages ------------------------------------------------------------------


class Away(Message, frozen=True):
    """Fails the way an actor fails when the database is away."""


class Outaged(Actor[Away | Echo | Boom]):
    async def receive(self, message: Away | Echo | Boom) -> Any:
        match message:
            case Away():
                raise StorageUnavailableError("cannot connect to PostgreSQL (connection refused)")
            case Boom(reason=reason):
                raise ValueError(reason)
            case Echo(value=value):
                return value * 2


async def test_a_child_failing_because_the_database_is_away_restarts_for_as_long_as_it_lasts() -> None:
    clock = FakeClock()
    outage = Backoff(initial=0.1, maximum=1.0, multiplier=2.0, jitter=0.5)
    sup = Supervisor(
        clock=clock,
        strategy=RestartStrategy(max_restarts=2, within=1000.0, outage=outage),
        outage=is_unavailable,
    )
    ref = sup.spawn(Outaged, name="patient")
    for _ in range(30):  # far more than max_restarts, all within the window
        await ref.tell(Away())
    assert await ref.ask(Echo(1)) == 2
    assert not sup.escalated.is_set() and ref.is_alive
    # Doubling from 0.1 s to the 1 s cap, each less up to half of it (jitter).
    for n, slept in enumerate(clock.sleeps, start=1):
        full = min(0.1 * 2 ** (n - 1), 1.0)
        assert full / 2 <= slept <= full
    assert len(clock.sleeps) == 30 and max(clock.sleeps) <= 1.0
    assert len(set(clock.sleeps[-10:])) > 1, "jittered, so processes do not come back in step"

    # A message handled in between: the next outage starts its backoff over.
    await ref.tell(Away())
    assert await ref.ask(Echo(2)) == 4
    assert clock.sleeps[-1] <= 0.1

    # Failures that are not an outage keep the restart intensity: the third one gives up.
    for i in range(3):
        await ref.tell(Boom(f"bug {i}"))
    await asyncio.wait_for(sup.escalated.wait(), 1.0)
    assert [(name, str(exc)) for name, exc in sup.failures] == [("patient", "bug 2")]
    await sup.stop()


def test_backoff_doubles_up_to_its_cap_less_its_jitter() -> None:
    plain = Backoff(initial=0.1, maximum=5.0, multiplier=2.0, jitter=0.0)
    assert [plain.delay(n) for n in range(1, 9)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    jittered = Backoff(initial=0.1, maximum=5.0, jitter=0.5)
    assert all(2.5 <= jittered.delay(20) <= 5.0 for _ in range(100))


def test_actor_stopped_error_is_a_bus_error_that_says_what_to_do() -> None:
    assert issubclass(ActorStoppedError, bus.errors.BusError)
    assert issubclass(ActorStoppedError, RuntimeError)  # what it was before
    assert bus.errors.ActorStoppedError is ActorStoppedError is bus.ActorStoppedError
