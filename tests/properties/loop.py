"""An event loop for hypothesis' stateful tests, whose rules are plain (synchronous) methods."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopEnv:
    """One event loop shared by every example of a stateful test; `run` drives a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)
