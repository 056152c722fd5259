"""A queue worker: W jobs of a queue topic in hand at once, each run by the user's handler.

    async def resize(job: bus.Message) -> dict | None: ...
    w = await b.worker("jobs", resize, concurrency=16)
    ...
    await w.stop()

One `QueueConsumer` underneath, so its leases, retries and dead letters hold:

- **Takes**: whenever slots are free, one `take` asks for as many jobs as
  there are free slots (one statement, shared with the other takes of the
  Bus at that moment); slots that free while it is out are asked for by a
  second take at once (at most two out). At most `concurrency` handlers run. A slot is free
  again when its handler returns: its ack is written beside the take that
  fills it, so a job's cycle waits for one round trip, not two (at most
  `concurrency` acks out at once; beyond that the worker waits for them).
- **Acks**: written after the handler returns, never before: a process that
  dies mid-handler leaves the job leased, and it comes back when its
  visibility timeout runs out. The acks of handlers that return while an
  ack statement is in flight go together in the next one (the Bus's queue
  writer coalesces them). A handler's return value other than None is the
  job's result (`b.job_result`), written with its ack.
- **Failures**: a handler that raises nacks its job with a backoff of
  `backoff` seconds doubling per attempt up to `max_backoff`; on its
  `max_attempts`-th attempt the job goes to the dead-letter topic instead.
- **Stop**: `stop()` takes nothing more and waits for the handlers in hand
  to finish and ack (up to `timeout`; then they are cancelled and their jobs
  given back at once).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from bus.queues import QueueConsumer
from bus.types import Message
from storage.errors import LeaseLostError, ValidationError
from storage.logs import get_logger
from storage.names import validate_int, validate_seconds

if TYPE_CHECKING:
    from bus.context import BusContext, Connected

__all__ = ["Worker"]

log = get_logger(__name__)

#: What `b.worker` runs for each job: its return value (None: none) is the job's result.
JobHandler = Callable[[Message], Awaitable[Any]]

# Takes out at once: the Bus's queue writer has two write slots per queue.
_TAKES_OUT = 2
# How long an idle take waits for a job before looking at the stop flag again (a NOTIFY
# wakes it at once; stop() cancels it).
_IDLE_TAKE = 5.0


class Worker:
    """Runs `handler` on the jobs of a queue topic, `concurrency` of them at a time (see bus.worker)."""

    def __init__(
        self,
        ctx: BusContext | Connected,
        topic: str,
        handler: JobHandler,
        *,
        concurrency: int = 1,
        visibility_timeout: float | timedelta = 30.0,
        max_attempts: int = 5,
        dead_letter: str | None = None,
        ordered_by_key: bool = False,
        backoff: float | timedelta = 1.0,
        max_backoff: float | timedelta = 60.0,
    ) -> None:
        if not callable(handler):
            raise ValidationError("handler must be an async function taking a bus.Message")
        if not inspect.iscoroutinefunction(handler) and not inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
        ):
            raise ValidationError("handler must be an async function (async def handler(job: bus.Message))")
        self.concurrency = validate_int(concurrency, "concurrency (jobs in hand at once)", 1, 10_000)
        self.backoff = validate_seconds(backoff, "backoff", allow_zero=True)
        self.max_backoff = validate_seconds(max_backoff, "max_backoff", allow_zero=True)
        self.topic = topic
        self._handler = handler
        self._consumer = QueueConsumer(
            ctx,
            topic,
            visibility_timeout=visibility_timeout,
            max_attempts=max_attempts,
            dead_letter=dead_letter,
            ordered_by_key=ordered_by_key,
        )
        self._running: set[asyncio.Task[None]] = set()
        self._acking: set[asyncio.Task[None]] = set()  # acks and nacks of handlers that returned
        self._slot_freed = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._takes: set[asyncio.Task[None]] = set()  # takes out
        self._asked = 0  # slots the takes out asked for
        self._stopping = False
        self.handled = 0  # jobs acked (or nacked, or dead-lettered) by this worker
        self._log = log.bind(topic=topic, consumer=self._consumer.consumer_id)

    @property
    def consumer_id(self) -> str:
        """The id the worker's leases are held under."""
        return self._consumer.consumer_id

    @property
    def in_hand(self) -> int:
        """Jobs taken and not yet acked or nacked."""
        return len(self._running)

    async def progress(self, job: Message, data: Any) -> None:
        """Report a job's progress from its handler: kept with the job, renewing its lease (see QueueConsumer.progress)."""
        await self._consumer.progress(job, data)

    async def start(self) -> Worker:
        """Open the queue consumer and start taking."""
        await self._consumer.start()
        self._loop = asyncio.get_running_loop().create_task(self._take_loop(), name=f"worker-{self.topic}")
        return self

    async def __aenter__(self) -> Worker:
        if self._loop is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self, timeout: float | timedelta | None = None) -> None:  # noqa: ASYNC109 - a grace period, not a deadline of this call's own I/O
        """Take nothing more; wait for the jobs in hand to finish and ack (up to `timeout` seconds, None: no limit).

        Handlers still running after `timeout` are cancelled and their jobs
        given back at once (the attempt not counted).
        """
        grace = None if timeout is None else validate_seconds(timeout, "timeout", allow_zero=True)
        if self._stopping:
            return
        self._stopping = True
        self._slot_freed.set()
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        for take in list(self._takes):  # a take cancelled gives back what it leased meanwhile
            take.cancel()
        if self._takes:
            await asyncio.gather(*self._takes, return_exceptions=True)
        if self._running:
            _, late = await asyncio.wait(set(self._running), timeout=grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)
        if self._acking:
            await asyncio.wait(set(self._acking))
        await self._consumer.close()

    async def _take_loop(self) -> None:
        """Take for the free slots, up to `_TAKES_OUT` takes out at once.

        A slot that frees while a take is out is asked for by another take at once (the Bus's
        queue writer sends it beside the first, or with the takes of that moment), instead of
        after the first came back.
        """
        running, takes = self._running, self._takes
        while not self._stopping:
            # A job's slot frees when its handler returns; its ack is written meanwhile (beside
            # the take that fills the slot again), as long as fewer than W acks are out.
            free = (
                self.concurrency - len(running) - self._asked - max(0, len(self._acking) - self.concurrency)
            )
            if free <= 0 or len(takes) >= _TAKES_OUT:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            self._asked += free
            task = asyncio.get_running_loop().create_task(self._take(free))
            takes.add(task)
            task.add_done_callback(takes.discard)
            await asyncio.sleep(0)  # let the take reach the writer before looking again

    async def _take(self, free: int) -> None:
        """One take for `free` slots; a handler task for each job it got."""
        try:
            jobs = await self._consumer.take(max_messages=free, timeout=_IDLE_TAKE)
        except asyncio.CancelledError:
            raise
        except Exception:  # the database away: the take comes again (the Bus's pool reconnects)
            self._log.warning("worker_take_failed", exc_info=True)
            await asyncio.sleep(1.0)
            jobs = []
        finally:
            self._asked -= free
            self._slot_freed.set()
        loop = asyncio.get_running_loop()
        for job in jobs:
            task = loop.create_task(self._run(job))
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._slot_freed.set()

    async def _run(self, job: Message) -> None:
        """Run the handler on one job, then have it acked (with its result) or nacked."""
        try:
            result = await self._handler(job)
        except asyncio.CancelledError:
            raise  # stop() gave up on it: the consumer's close gives the job back
        except Exception as exc:
            self._settle(self._nack(job, exc))
            return
        self._settle(self._ack(job, result))

    def _settle(self, write: Coroutine[Any, Any, None]) -> None:
        """Write a job's ack or nack in a task of its own: the handler's slot is free meanwhile."""
        task = asyncio.get_running_loop().create_task(write)
        self._acking.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._acking.discard(task)
        self._slot_freed.set()

    async def _nack(self, job: Message, exc: Exception) -> None:
        """Back to the queue after the backoff, or to the dead-letter topic on its last attempt."""
        delay = min(self.max_backoff, self.backoff * (2 ** (job.attempt - 1)))
        try:
            await self._consumer.nack(job, delay=delay, error=f"{type(exc).__name__}: {exc}")
        except LeaseLostError:
            self._log.warning("worker_nack_lost", partition=job.partition, offset=job.offset)
        except Exception:  # its lease runs out and it comes back
            self._log.warning("worker_nack_failed", partition=job.partition, offset=job.offset, exc_info=True)
        self.handled += 1

    async def _ack(self, job: Message, result: Any) -> None:
        """Ack the job (with the handler's result); one the lease of which was lost is only logged."""
        consumer = self._consumer
        try:
            await consumer.ack(job, result=result)
        except LeaseLostError:
            self._log.warning("worker_ack_lost", partition=job.partition, offset=job.offset)
        except ValidationError:
            self._log.error(
                "worker_result_not_stored", partition=job.partition, offset=job.offset, exc_info=True
            )
            await consumer.ack(job)
        except Exception:  # its lease runs out and it comes back
            self._log.warning("worker_ack_failed", partition=job.partition, offset=job.offset, exc_info=True)
        self.handled += 1
