"""Helpers of the observability tests: fast timings, metric samples, waiting for a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import bus.metrics

FAST: dict[str, Any] = dict(
    heartbeat_interval=0.2,
    session_timeout=1.5,
    rebalance_delay=0.1,
    max_poll_interval=0.5,
    lease_time=5.0,
)


def value(name: str, **labels: str) -> float:
    """One sample of the bus registry (0.0 when absent)."""
    return bus.metrics.value(name, **labels)


async def eventually(check: Callable[[], Awaitable[Any] | Any], timeout: float = 15.0, every: float = 0.05) -> Any:  # noqa: ASYNC109
    """Poll `check` until it returns something truthy; fail with its last value after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = check()
        if isinstance(last, Awaitable):
            last = await last
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")
