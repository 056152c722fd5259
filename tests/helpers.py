"""What tests of several capabilities share: polling consumers until messages arrive."""

from __future__ import annotations

import asyncio
from typing import Any

import bus
from bus.testing import eventually


async def drain(consumers: list[Any], n: int, timeout: float = 20.0) -> list[Any]:  # noqa: ASYNC109 - a test helper: the deadline is the point
    """Poll all consumers round-robin until `n` messages arrived in total, or `timeout` seconds passed: what came."""
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < n and loop.time() < deadline:
        for c in consumers:
            got.extend(await c.poll(timeout=0.05))
    return got


async def poll_until(c: bus.Consumer, n: int, timeout: float = 20.0) -> list[bus.Message]:  # noqa: ASYNC109 - a test helper: the deadline is the point
    """Poll `c` until `n` messages arrived: them, or AssertionError after `timeout` seconds."""
    got: list[bus.Message] = []

    async def more() -> bool:
        got.extend(await c.poll(timeout=0.05))
        return len(got) >= n

    await eventually(more, timeout=timeout, every=0)
    return got
