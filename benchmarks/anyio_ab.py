"""anyio against what the actors use today: the A/B that decides whether anyio replaces it.

Each row runs the same work both ways, interleaved, in one process; the value is anyio's rate,
the baseline the bus's own primitive, so the ratio reads "anyio's speed relative to ours"
(higher is better; the bar for adopting anyio on a hot path is ≥ 0.95×):

* mailbox: one producer sends N messages through a bounded channel to one consumer. Ours:
  `actors.runtime._Mailbox` (a deque with two events, closable). anyio: a memory object stream
  of the same capacity (`send`/`async for`), which yields to the event loop on every send and
  receive.
* timeout: N awaits of a coroutine that returns at once, each under a 5 s deadline. Ours:
  `asyncio.timeout`; anyio: `fail_after`.
* task group: groups of 10 tasks that return at once, started and joined. Ours:
  `asyncio.TaskGroup`; anyio: `create_task_group` / `start_soon`.

Needs no database. Run it alone with `bus bench anyio_ab`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio

from actors.runtime import _Mailbox
from benchmarks.result import Result

SCENARIO = "anyio_ab"


async def _noop() -> int:
    return 1


async def _mailbox(n: int, capacity: int) -> float:
    box = _Mailbox(capacity)

    async def produce() -> None:
        for i in range(n):
            await box.put(i)  # type: ignore[arg-type]
        box.close()

    started = time.perf_counter()
    producer = asyncio.create_task(produce())
    while await box.get() is not None:
        pass
    await producer
    return n / (time.perf_counter() - started)


async def _stream(n: int, capacity: int) -> float:
    send, receive = anyio.create_memory_object_stream[int](capacity)

    async def produce() -> None:
        async with send:
            for i in range(n):
                await send.send(i)

    started = time.perf_counter()
    producer = asyncio.create_task(produce())
    async with receive:
        async for _ in receive:
            pass
    await producer
    return n / (time.perf_counter() - started)


async def _timeouts_asyncio(n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        async with asyncio.timeout(5):
            await _noop()
    return n / (time.perf_counter() - started)


async def _timeouts_anyio(n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        with anyio.fail_after(5):
            await _noop()
    return n / (time.perf_counter() - started)


async def _groups_asyncio(n: int) -> float:
    started = time.perf_counter()
    for _ in range(n // 10):
        async with asyncio.TaskGroup() as tg:
            for _ in range(10):
                tg.create_task(_noop())
    return n / (time.perf_counter() - started)


async def _groups_anyio(n: int) -> float:
    started = time.perf_counter()
    for _ in range(n // 10):
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(_noop)
    return n / (time.perf_counter() - started)


async def _ab(
    ours: Callable[[], Awaitable[float]], theirs: Callable[[], Awaitable[float]], runs: int
) -> tuple[float, float]:
    """Medians of `runs` interleaved runs: (anyio's rate, ours)."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(runs):
        b.append(await ours())
        a.append(await theirs())
    return statistics.median(a), statistics.median(b)


async def run(dsn: str, quick: bool) -> list[Result]:
    n = 20_000 if quick else 200_000
    runs = 3 if quick else 7
    rows = []
    for capacity in (1000, 10):
        theirs, ours = await _ab(lambda c=capacity: _mailbox(n, c), lambda c=capacity: _stream(n, c), runs)
        rows.append(
            Result(
                SCENARIO,
                f"mailbox, capacity {capacity}: anyio memory object stream",
                round(theirs),
                "msg/s",
                baseline=round(ours),
                baseline_name="actors.runtime mailbox",
                target="≥ 0.95×",
                extra={"messages": n, "runs": runs},
            )
        )
    theirs, ours = await _ab(lambda: _timeouts_asyncio(n), lambda: _timeouts_anyio(n), runs)
    rows.append(
        Result(
            SCENARIO,
            "timeout: anyio.fail_after",
            round(theirs),
            "calls/s",
            baseline=round(ours),
            baseline_name="asyncio.timeout",
            target="≥ 0.95×",
            extra={"calls": n, "runs": runs},
        )
    )
    tasks = n // 10
    theirs, ours = await _ab(lambda: _groups_asyncio(tasks), lambda: _groups_anyio(tasks), runs)
    rows.append(
        Result(
            SCENARIO,
            "task group of 10: anyio.create_task_group",
            round(theirs),
            "tasks/s",
            baseline=round(ours),
            baseline_name="asyncio.TaskGroup",
            target="≥ 0.95×",
            extra={"tasks": tasks, "runs": runs},
        )
    )
    return rows
