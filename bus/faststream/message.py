"""`BusMessage`: a bus Message as FastStream sees it, and the settling state of the delivery under way."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

from faststream.message import StreamMessage

from bus.types import Message

if TYPE_CHECKING:
    from bus.queues import QueueConsumer


# The queue consumer that leased the message in hand, the list its verdict goes to and the list of
# queue jobs waiting for their ack (set by the subscriber around each message, read by the parser),
# so an ack reaches the consumer that leased it.
_current: contextvars.ContextVar[tuple[QueueConsumer | None, list[str], list[Message] | None] | None] = (
    contextvars.ContextVar("bus_faststream_current", default=None)
)


class BusMessage(StreamMessage[Message]):
    """A bus Message as FastStream sees it; ack/nack/reject decide what the subscriber does next."""

    queue: QueueConsumer | None = None
    verdicts: list[str] | None = None
    acks: list[Message] | None = None

    def _note(self, verdict: str) -> None:
        if self.verdicts is not None:
            self.verdicts.append(verdict)

    async def _settle(self, verdict: str) -> None:
        """Record the verdict once; a queue job is nacked for "nack", acked for "ack" and "reject".

        A queue subscriber's acks wait in `acks` and go out with the other acks of the jobs it took
        together, in one statement, once their handlers are done (see `BusSubscriber._queue_loop`).
        """
        if self.committed is None:
            self._note(verdict)
            if self.queue is not None:
                if verdict == "nack":
                    await self.queue.nack(self.raw_message)
                elif self.acks is not None:
                    self.acks.append(self.raw_message)
                else:
                    await self.queue.ack(self.raw_message)

    async def ack(self) -> None:
        await self._settle("ack")
        await super().ack()

    async def nack(self) -> None:
        await self._settle("nack")
        await super().nack()

    async def reject(self) -> None:
        await self._settle("reject")
        await super().reject()
