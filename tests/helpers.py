"""Small helpers for group tests: drain several consumers."""

from __future__ import annotations

import asyncio
from typing import Any


async def drain(consumers: list[Any], n: int, timeout: float = 20.0) -> list[Any]:
    """Poll all consumers round-robin until `n` messages arrived in total."""
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < n and loop.time() < deadline:
        for c in consumers:
            got.extend(await c.poll(timeout=0.05))
    return got
