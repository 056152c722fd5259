"""A lane: requests of one kind from many tasks, coalesced into few writes.

The queue consumers' takes and acks and the handler-mode commits of a
member's partition workers go through lanes, the way pool publishes go
through the Producer: with a write slot free a request is written at once
(no added latency); while `parallel` writes are out, whatever arrives waits
and goes in the next one (at most `cap` requests per write). Every request
carries its own future (its last item), which its write answers, or fails
with the write's exception. A lane is a channel between tasks of one event
loop, nothing more: requests in, answers back through the futures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

Request = TypeVar("Request", bound=tuple[Any, ...])


class Lane(Generic[Request]):
    """Requests of one kind, coalesced: up to `parallel` writes out at once, and what arrives
    while they all are out waits and joins the next one."""

    def __init__(self, write: Callable[[list[Request]], Awaitable[None]], cap: int, parallel: int) -> None:
        self._write: Callable[[list[Request]], Awaitable[None]] = write
        self._cap = cap
        self._parallel = parallel
        self._running: set[asyncio.Task[None]] = set()  # held, so no running write is collected
        self._pending: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue `request` (a tuple whose last item is its future); written at once when a write slot is free."""
        self._pending.append(request)
        if len(self._running) < self._parallel:
            task = asyncio.get_running_loop().create_task(self._run(), name="lane-writer")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self._cap], self._pending[self._cap :]
            try:
                await self._write(batch)
            except BaseException as exc:  # every request of the batch gets the error
                for request in batch:
                    if not request[-1].done():
                        request[-1].set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
