"""start_eagerly: a task whose coroutine runs at once, up to its first real wait."""

from __future__ import annotations

import asyncio

import pytest

from actors.runtime import start_eagerly


async def test_the_coroutine_runs_up_to_its_first_wait_before_start_eagerly_returns() -> None:
    steps: list[str] = []
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def work() -> int:
        steps.append("before the wait")
        value = await gate
        steps.append("after the wait")
        return value + 1

    task = start_eagerly(work())
    assert steps == ["before the wait"]  # a create_task'd coroutine would not have started yet
    gate.set_result(41)
    assert await task == 42
    assert steps == ["before the wait", "after the wait"]


async def test_a_coroutine_that_never_waits_gives_a_finished_task() -> None:
    async def at_once() -> str:
        return "done"

    task = start_eagerly(at_once())
    assert task.done()
    assert await task == "done"


async def test_an_error_before_the_first_wait_is_the_tasks_error() -> None:
    async def broken() -> None:
        raise ValueError("bad input")

    task = start_eagerly(broken())
    with pytest.raises(ValueError, match="bad input"):
        await task


async def test_an_error_after_the_first_wait_is_the_tasks_error() -> None:
    async def later() -> None:
        await asyncio.sleep(0)
        raise KeyError("late")

    with pytest.raises(KeyError):
        await start_eagerly(later())


async def test_cancelling_the_task_reaches_the_coroutine_where_it_waits() -> None:
    cleaned: list[str] = []
    started = asyncio.Event()

    async def waits_forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cleaned.append("cancelled")
            raise

    task = start_eagerly(waits_forever())
    await asyncio.sleep(0)  # the task has taken its first step
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["cancelled"]


async def test_a_task_cancelled_before_its_first_step_still_cancels_the_coroutine() -> None:
    cleaned: list[str] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("cleaned up")

    task = start_eagerly(waits_forever())
    task.cancel()  # in the same turn: the backport's task never resumed the coroutine
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # done callbacks run
    assert cleaned == ["cleaned up"]


async def test_a_coroutine_that_catches_cancellation_goes_on_and_returns() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0)
            return "finished anyway"
        return "slept"

    task = start_eagerly(stubborn())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "finished anyway"
