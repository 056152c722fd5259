"""A lane: requests of one kind from many tasks, coalesced into few writes.

The queue consumers' takes and acks go through lanes, the way pool
publishes go through the Producer: with a write slot free a request is
written at once (no added latency); while `parallel` writes are out,
whatever arrives waits and goes in the next one (at most `cap` requests per
write). Every request
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
    while they all are out waits and joins the next one.

    Requests that arrive in the same event-loop turn go in one write, up to `cap`
    requests and `split_at` in total `weight` (say, rows): a statement's fixed cost
    is shared by many small requests, while big ones use the free write slots side
    by side instead of queueing behind each other in one long statement.
    """

    def __init__(
        self,
        write: Callable[[list[Request]], Awaitable[None]],
        cap: int,
        parallel: int,
        *,
        weight: Callable[[Request], int] | None = None,
        split_at: int = 0,
    ) -> None:
        self._write: Callable[[list[Request]], Awaitable[None]] = write
        self._cap = cap
        self._parallel = parallel
        self._weight = weight
        self._split_at = split_at
        self._active = 0  # writers running; counted down by the writer itself, before it ends
        self._tasks: set[asyncio.Task[None]] = set()  # held, so no running writer is collected
        self._pending: list[Request] = []

    def reshape(self, parallel: int, split_at: int) -> None:
        """From the next write on: at most `parallel` writes out at once, split at `split_at` weight (0: never)."""
        self._parallel = parallel
        self._split_at = split_at

    def add(self, request: Request) -> None:
        """Queue `request` (a tuple whose last item is its future); written at once when a write slot is free."""
        self._pending.append(request)
        if self._active < self._parallel:
            self._start()

    def _start(self) -> None:
        self._active += 1
        task = asyncio.get_running_loop().create_task(self._run(), name="lane-writer")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _next_batch(self) -> list[Request]:
        """What the next write takes: at least one request, then up to `cap` requests and `split_at` weight."""
        count = min(len(self._pending), self._cap)
        if self._weight is not None and self._split_at > 0:
            total = 0
            for i in range(count):
                total += self._weight(self._pending[i])
                if total >= self._split_at:
                    count = i + 1
                    break
        batch, self._pending = self._pending[:count], self._pending[count:]
        return batch

    async def _run(self) -> None:
        try:
            while self._pending:
                batch = self._next_batch()
                if self._pending and self._active < self._parallel:
                    self._start()  # what is left goes side by side, in a slot of its own
                try:
                    await self._write(batch)
                except BaseException as exc:  # every request of the batch gets the error
                    for request in batch:
                        if not request[-1].done():
                            request[-1].set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
        finally:
            # No await between the last look at `_pending` and this: a request added after it
            # sees the free slot and starts a writer of its own.
            self._active -= 1
