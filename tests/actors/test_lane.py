"""Lanes: requests of one moment coalesced, split by weight, none stranded."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.lane import Lane


async def test_a_request_added_as_the_last_writer_ends_is_written() -> None:
    written: list[str] = []

    async def write(batch: list[Any]) -> None:
        for name, answer in batch:
            written.append(name)
            answer.set_result(None)

    lane: Lane[Any] = Lane(write, cap=10, parallel=1)
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    # The first answer's callback runs after its writer looked at the pending list for the last
    # time, but before the writer's task has finished: the new request must still be written.
    first.add_done_callback(lambda _: lane.add(("b", second)))
    lane.add(("a", first))
    await asyncio.wait_for(second, 2)
    assert written == ["a", "b"]


async def test_requests_of_one_moment_share_a_write_up_to_the_split_weight() -> None:
    writes: list[list[int]] = []
    gate = asyncio.Event()

    async def write(batch: list[Any]) -> None:
        writes.append([n for n, _ in batch])
        await gate.wait()
        for _, answer in batch:
            answer.set_result(None)

    lane: Lane[Any] = Lane(write, cap=100, parallel=2, weight=lambda r: r[0], split_at=100)
    loop = asyncio.get_running_loop()
    answers = [loop.create_future() for _ in range(5)]
    for n, answer in zip([10, 20, 30, 60, 5], answers, strict=True):
        lane.add((n, answer))
    await asyncio.sleep(0.05)
    # 10 + 20 + 30 + 60 reach the split weight: the rest goes side by side in the second slot.
    assert writes == [[10, 20, 30, 60], [5]]
    gate.set()
    await asyncio.wait_for(asyncio.gather(*answers), 2)
