"""Small helpers for group tests: wait for a condition instead of sleeping blindly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(check: Callable[[], Awaitable[Any] | Any], timeout: float = 15.0, every: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy; fail with its last value after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = check()
        if asyncio.iscoroutine(last) or isinstance(last, Awaitable):
            last = await last
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")


async def drain(consumers: list[Any], n: int, timeout: float = 20.0) -> list[Any]:
    """Poll all consumers round-robin until `n` messages arrived in total."""
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < n and loop.time() < deadline:
        for c in consumers:
            got.extend(await c.poll(timeout=0.05))
    return got
