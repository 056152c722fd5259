"""A Bus's time (BusTime): real time that a test moves forward, for its statements and its actors' timers."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import bus
from actors import Actor, BusTime, Message, RestartStrategy, Supervisor


class Tick(Message, frozen=True):
    pass


class Fail(Message, frozen=True):
    pass


class Ping(Message, frozen=True):
    pass


class Ticks(Actor[Tick | Fail | Ping]):
    def __init__(self, journal: list[str]) -> None:
        self.journal = journal

    async def on_start(self) -> None:
        self.journal.append("start")

    async def receive(self, message: Tick | Fail | Ping) -> Any:
        match message:
            case Tick():
                self.journal.append("tick")
            case Fail():
                raise ValueError("fails")
            case Ping():
                return "pong"
        return None


async def _turns(n: int = 10) -> None:
    """Let the woken tasks run (no real time needs to pass)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_an_advance_past_the_end_of_a_sleep_ends_it_at_once() -> None:
    time = BusTime()
    sleeper = asyncio.create_task(time.sleep(3600))
    await _turns()
    assert not sleeper.done()
    time.advance(3600)
    await _turns()
    assert sleeper.done()


async def test_an_advance_short_of_the_end_leaves_the_rest_to_sleep() -> None:
    time = BusTime()
    sleeper = asyncio.create_task(time.sleep(100))
    await _turns()
    time.advance(60)
    await _turns()
    assert not sleeper.done()  # 40 s left
    time.advance(timedelta(seconds=40))
    await _turns()
    assert sleeper.done()


async def test_statements_judge_by_the_server_until_moved_and_again_after_judge_by_server() -> None:
    time = BusTime()
    assert time.now() is None  # the server's clock
    before = time.monotonic()
    time.advance(31)
    moved = time.now()
    assert moved is not None
    assert datetime.now(UTC) + timedelta(seconds=30) < moved <= datetime.now(UTC) + timedelta(seconds=31)
    assert time.monotonic() >= before + 31
    time.judge_by_server()
    assert time.now() is None
    assert time.monotonic() >= before + 31  # timers are not set back
    time.advance(5)  # a new advance counts from the wall clock again
    again = time.now()
    assert again is not None and again <= datetime.now(UTC) + timedelta(seconds=5)


def test_time_does_not_go_back() -> None:
    time = BusTime()
    with pytest.raises(bus.ValidationError, match="advance"):
        time.advance(-1)
    assert time.now() is None


async def test_the_timers_of_actors_on_a_moved_time_fire_without_waiting() -> None:
    time = BusTime()
    journal: list[str] = []
    sup = Supervisor("timed", clock=time)
    ref = sup.spawn(lambda: Ticks(journal), "ticks")
    assert await ref.ask(Ping()) == "pong"
    ref.schedule_every(3600, Tick())
    ref.schedule_once(7200, Tick())
    await _turns()
    assert journal.count("tick") == 0
    time.advance(3600)  # the periodic tick is due, the one-off not yet
    await _turns()
    assert journal.count("tick") == 1
    time.advance(3600)  # both are due
    await _turns()
    assert journal.count("tick") == 3
    await sup.stop()


async def test_a_restart_backoff_on_a_moved_time_ends_when_the_time_passes_it() -> None:
    time = BusTime()
    journal: list[str] = []
    strategy = RestartStrategy(max_restarts=3, within=3600.0, backoff_initial=600.0, backoff_max=600.0)
    sup = Supervisor("backoff", clock=time, strategy=strategy)
    ref = sup.spawn(lambda: Ticks(journal), "ticks")
    await ref.tell(Fail())
    await _turns()
    assert journal == ["start"]  # waiting out ten minutes before the restart
    time.advance(600)
    assert await ref.ask(Ping()) == "pong"
    assert journal == ["start", "start"]
    await sup.stop()
