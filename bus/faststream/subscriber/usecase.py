"""`BusSubscriber`: a group member on a pubsub topic, competing consumers on a queue topic."""

from __future__ import annotations

import abc
import asyncio
import contextvars
import dataclasses
import logging
import sys
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from faststream.exceptions import IncorrectState, SubscriberNotFound
from faststream.message import StreamMessage
from faststream.middlewares import AckPolicy
from faststream.middlewares.logging import CriticalLogMiddleware
from faststream.response import Response, ensure_response

import bus as _bus
from bus.consumer import Retry
from bus.faststream._compat import (
    CallsCollection,
    ContextRepo,
    SubscriberUsecase,
    TasksMixin,
    middlewares_stack,
)
from bus.faststream.configs import BusBrokerConfig
from bus.faststream.message import BusMessage, _current
from bus.faststream.parser import _process_msg, decode, decode_batch, parse_batch, parse_message
from bus.faststream.publisher.fake import _ReplyPublisher
from bus.faststream.publisher.producer import _ensure_topic
from bus.faststream.subscriber.config import BusSubscriberConfig
from bus.faststream.subscriber.specification import BusSubscriberSpecification
from bus.types import Message, Outgoing

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from bus.client import Bus
    from bus.consumer import Consumer
    from bus.queues import QueueConsumer


_TAKE = 10  # jobs a queue subscriber takes at a time
_ACK_AFTER = frozenset({AckPolicy.ACK, AckPolicy.NACK_ON_ERROR, AckPolicy.REJECT_ON_ERROR})


class _Retried(Exception):
    """A nacked pubsub message: raised to the group's worker so its Retry policy runs."""


# The subscriber whose handler the current task runs (a stop called from a handler, FastStream's
# StopConsume, must not wait for that handler).
_handling: contextvars.ContextVar[BusSubscriber | None] = contextvars.ContextVar(
    "bus_faststream_handling", default=None
)


class InMemoryConnection(abc.ABC):
    """The connection of a BusBroker under the in-memory TestBusBroker (`bus.faststream.testing`).

    A subscriber started on it is checked and fed by it, not by the database.
    """

    @abc.abstractmethod
    def check(self, sub: BusSubscriber) -> None:
        """Refuse a subscriber the real broker would refuse at start."""

    @abc.abstractmethod
    async def take(self, sub: BusSubscriber, timeout: float) -> Message | None:  # noqa: ASYNC109
        """The next message held for a subscriber without a handler (None after `timeout` seconds)."""


class BusSubscriber(TasksMixin, SubscriberUsecase[Message]):
    """One `@broker.subscriber`: a group member on a pubsub topic, competing consumers on a queue topic."""

    _outer_config: BusBrokerConfig

    def __init__(
        self,
        config: BusSubscriberConfig,
        specification: BusSubscriberSpecification,
        calls: CallsCollection[Message],
    ) -> None:
        config.parser = parse_batch if config.batch else parse_message
        config.decoder = decode_batch if config.batch else decode
        super().__init__(config, specification, calls)
        self._topic = config.topic
        self.group = config.group
        self._retry = config.retry
        self._dead_letter = config.dead_letter
        self._start = config.start
        self._visibility = config.visibility_timeout
        self.batch = config.batch
        self._max_records = config.max_records
        self._partitions = config.partitions
        self._consumer: Consumer | None = None
        self._subscription: Any = None
        self._queue: QueueConsumer | None = None
        self._acks: list[Message] = []  # queue jobs handled, their acks not written yet
        self._pipeline_key: Any = None
        self._stopping: asyncio.Future[None] | None = None
        self._abandoned = False  # stopped past graceful_timeout, or from a handler: give back the rest
        self._scopes: set[asyncio.Timeout] = set()  # the group's handlers under way
        self._pipeline_built: tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]] = ((), ())

    @property
    def topic(self) -> str:
        return f"{self._outer_config.prefix}{self._topic}"

    def get_log_context(self, message: StreamMessage[Message] | None) -> dict[str, str]:
        return {
            "topic": self.topic,
            "group": self.group or "",
            "message_id": getattr(message, "message_id", ""),
        }

    def _make_response_publisher(self, message: StreamMessage[Any]) -> Sequence[Any]:
        return (_ReplyPublisher(self._outer_config.producer, message.reply_to),)

    # -- the per-message pipeline --------------------------------------------------------------
    #
    # FastStream's `SubscriberUsecase.process_message`, step for step: the subscriber's lock and
    # context scope, the middlewares entered in order and left in reverse (an error one of them
    # handles goes no further out), the first suitable call, its result published to the reply
    # topic and the handler's publishers. What stays the same from one message to the next (the
    # middleware factories, the scope's items) is built once, the middlewares nest as `async with`
    # blocks instead of an AsyncExitStack, the message's scope is left without an ExitStack, and a
    # broker without a logger (`logger=None`) leaves out FastStream's error-logging middleware,
    # which would only log to nothing. Each of these is work FastStream's own does per message, on
    # top of calling the handler, where `subscribe` pays the handler call alone.

    def _pipeline(self) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]:
        """(middleware factories, context scope items), built again only if the broker's changed."""
        config = self._outer_config
        logger = config.logger.logger.logger
        key = (config.broker_middlewares, self.ack_policy, logger)
        if self._pipeline_key != key:
            self._pipeline_key = key
            factories = middlewares_stack(self)
            if logger is None:
                factories = tuple(f for f in factories if not isinstance(f, CriticalLogMiddleware))
            self._pipeline_built = (
                factories,
                (("handler_", self), ("logger", logger), *config.extra_context.items()),
            )
        return self._pipeline_built

    async def process_message(self, msg: Message) -> Response:
        context = self._outer_config.context
        factories, scope = self._pipeline()
        message_scope: list[Any] = []  # the message's own context scope, once a call took it
        with self.lock, context.scopes(scope):
            try:
                return await self._enter(msg, context, factories, 0, [], message_scope)
            finally:
                for entered in message_scope:
                    entered.__exit__(None, None, None)

    async def _enter(
        self,
        msg: Message,
        context: ContextRepo,
        factories: tuple[Any, ...],
        index: int,
        middlewares: list[Any],
        message_scope: list[Any],
    ) -> Response:
        if index == len(factories):
            return await self._call(msg, context, middlewares, message_scope)
        middleware = factories[index](msg, context=context)
        middlewares.append(middleware)
        async with middleware:
            # A middleware's `on_receive` may replace the message it was given (`self.msg =
            # msgspec.structs.replace(self.msg, ...)`: a bus Message is frozen); the next sees that.
            msg = getattr(middleware, "msg", msg)
            return await self._enter(msg, context, factories, index + 1, middlewares, message_scope)
        return ensure_response(None)  # the error was handled by a middleware

    async def _call(
        self, msg: Message, context: ContextRepo, middlewares: list[Any], message_scope: list[Any]
    ) -> Response:
        cache: dict[Any, Any] = {}
        for h in self.calls:
            message = await h.is_suitable(msg, cache)  # a parsing error goes out through the middlewares
            if message is None:
                continue
            entered = context.scopes((("log_context", self.get_log_context(message)), ("message", message)))
            entered.__enter__()
            message_scope.append(entered)
            result = ensure_response(
                await h.call(message=message, _extra_middlewares=(m.consume_scope for m in middlewares[::-1]))
            )
            if not result.correlation_id:
                result.correlation_id = message.correlation_id
            replies = () if not message.reply_to or self._no_reply else self._make_response_publisher(message)
            for p in (*replies, *h.handler._publishers):
                await p._publish(
                    result.as_publish_command(),
                    _extra_middlewares=(m.publish_scope for m in middlewares[::-1]),
                )
            return result
        raise SubscriberNotFound(f"There is no suitable handler for {msg=}")

    async def start(self) -> None:
        self._stopping = None
        self._abandoned = False
        await super().start()
        connection = self._outer_config.connection
        if isinstance(connection, InMemoryConnection):
            connection.check(self)  # refuses what the database would
            self._post_start()  # TestBusBroker: publishes are routed to the subscriber in memory
            return
        info = await self._topic_info(connection)
        if info.semantics == "queue" and self.batch:
            raise _bus.ValidationError(
                f"batch=True reads a pubsub topic; {self.topic!r} is a queue: "
                "subscribe without batch (each job is acked on its own)"
            )
        if info.semantics == "queue":
            self._queue = connection.queue_consumer(
                self.topic,
                visibility_timeout=self._visibility,
                max_attempts=(self._retry or Retry()).max_attempts,
                dead_letter=self._dead_letter,
            )
            await self._queue.start()
            if self.calls:
                self.add_task(self._queue_loop)
            self._post_start()
            return
        if self.group is None:
            raise _bus.ValidationError(
                f"subscriber on pubsub topic {self.topic!r} needs group=...: each group reads every message once"
            )
        if self.batch or not self.calls:  # a batch subscriber, or one read by get_one and iteration
            self._consumer = connection.consumer(
                self.group,
                topics=[self.topic],
                start=self._start,
                auto_commit=False,
                max_poll_records=self._max_records if self.batch else 1,
            )
            await self._consumer.start()
            if self.calls:
                self.add_task(self._batch_loop)
            self._post_start()
            return
        self._subscription = await connection.subscribe(
            self.group,
            self._handle,
            topics=[self.topic],
            start=self._start,
            retry=self._retry,
            dead_letter=self._dead_letter,
        )
        self._post_start()

    async def _topic_info(self, connection: Bus) -> Any:
        """The topic's info; with `create_topics` a missing topic is created (pubsub)."""
        try:
            return await connection.topic(self.topic)
        except _bus.TopicNotFoundError:
            if not self._outer_config.create_topics:
                raise
        await _ensure_topic(connection, self.topic, self._partitions or 1)
        return await connection.topic(self.topic)

    # -- get_one and iteration: a subscriber without a handler -----------------------------------

    async def get_one(self, *, timeout: float = 5.0) -> BusMessage | None:  # noqa: ASYNC109 - FastStream's signature
        """The next message (None after `timeout` seconds), acknowledged as it is handed out.

        A pubsub subscriber's group commits past it; a queue subscriber acks the job.
        """
        assert not self.calls, "You can't use `get_one` method if subscriber has registered handlers."
        raw = await self._take_one(timeout)
        if raw is None:
            return None
        return await self._parsed_one(raw)

    async def __aiter__(self) -> AsyncIterator[BusMessage]:
        assert not self.calls, "You can't use iterator if subscriber has registered handlers."
        while True:
            raw = await self._take_one(5.0)
            if raw is not None:
                yield await self._parsed_one(raw)

    async def _take_one(self, timeout: float) -> Message | None:  # noqa: ASYNC109
        connection = self._outer_config.connection
        if isinstance(connection, InMemoryConnection):
            return await connection.take(self, timeout)
        if self._queue is not None:
            taken = await self._queue.take(max_messages=1, timeout=timeout)
            if taken:
                await self._queue.ack(taken[0])
            return taken[0] if taken else None
        if self._consumer is None:
            raise IncorrectState(f"subscriber on {self.topic!r} is not started: `await broker.start()`")
        got = await self._consumer.poll(timeout=timeout, max_records=1)
        if not got:
            return None
        await self._consumer.commit()
        return got[0]

    async def _parsed_one(self, raw: Message) -> BusMessage:
        context = self._outer_config.context
        parser, decoder = self._get_parser_and_decoder()
        msg: BusMessage = await _process_msg(
            msg=raw,
            middlewares=(m(raw, context=context) for m in self._broker_middlewares),
            parser=parser,
            decoder=decoder,
        )
        return msg

    async def stop(self) -> None:
        """Stop consuming; waits up to the broker's `graceful_timeout` for the handlers under way.

        Called from a handler (FastStream's `StopConsume`), it returns at once: the subscriber stops
        once that handler has returned, and nothing after it is handed to a handler or committed.
        """
        if self._stopping is None:
            self._abandoned = self._abandoned or _handling.get() is self
            self._stopping = asyncio.ensure_future(self._stop())
        if _handling.get() is self:
            return
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        # A group member stops as `Subscription.stop` does: its workers hand the rest of what they
        # fetched to the handler, commit what it handled and release their partitions. The subscriber
        # is marked stopped only then: a message FastStream skipped as "not running" would count as
        # handled, and be committed unseen. After `graceful_timeout` the handlers still running are
        # cancelled (FastStream neither acks nor nacks a cancelled message) and what the workers
        # still hold is given back uncommitted: the group's next member gets it.
        if self._subscription is not None:
            stopping = asyncio.ensure_future(self._subscription.stop())
            timeout = self._outer_config.graceful_timeout
            if not self._abandoned and timeout:
                await asyncio.wait({stopping}, timeout=timeout)
            if not stopping.done():
                self._abandon()
            with suppress(Exception):
                await stopping
            self._subscription = None
        # Waits for the message (or batch) in hand, handled and committed or acked, then ends the loops.
        await super().stop()
        if self._consumer is not None:
            with suppress(Exception):
                await self._consumer.close()
            self._consumer = None
        if self._queue is not None:
            await self._write_acks(self._queue)  # handled before the stop: acked, not given back
            with suppress(Exception):
                await self._queue.close()
            self._queue = None

    def _abandon(self) -> None:
        """Give back what the group's workers hold: cancel the handlers, hand nothing more to one.

        A message given back raises in the worker as a nack would; its retries are made unlimited
        first, so it is neither dead-lettered nor stops its partition: the worker stops with it
        uncommitted.
        """
        self._abandoned = True
        if self._subscription is not None:
            handoff = self._subscription._h
            handoff.retry = dataclasses.replace(handoff.retry, max_attempts=sys.maxsize)
        now = asyncio.get_running_loop().time()
        for scope in list(self._scopes):
            scope.reschedule(now)

    async def _handle(self, raw: Message) -> None:
        """The group worker's handler: a nacked message raises so the group's Retry runs."""
        if self._abandoned:
            raise _Retried(f"{raw.topic}/{raw.partition}@{raw.offset} given back: the subscriber stopped")
        token = _handling.set(self)
        scope = asyncio.timeout(None)  # cancelled by a stop once graceful_timeout has passed
        self._scopes.add(scope)
        try:
            async with scope:
                verdict = await self._run(raw, None)
        except TimeoutError:
            if not scope.expired():
                raise
            raise _Retried(
                f"{raw.topic}/{raw.partition}@{raw.offset} cancelled: the subscriber stopped"
            ) from None
        finally:
            self._scopes.discard(scope)
            _handling.reset(token)
        if verdict == "nack" or self._abandoned:
            raise _Retried(f"{raw.topic}/{raw.partition}@{raw.offset} nacked by its handler")

    async def _batch_loop(self) -> None:
        """`batch=True`: poll a batch, hand it to the pipeline once, commit it after the handler.

        A nacked batch is rewound and comes again (with what joined it since) after the Retry's
        backoff; after its last attempt it goes to the dead-letter topic and is committed, or,
        without one, the subscriber stops there with nothing committed past it (as a group's
        partition does).
        """
        consumer = self._consumer
        assert consumer is not None
        policy = (self._retry or Retry()).policy()
        failed: dict[tuple[str, str, int], int] = {}  # the attempts of a nacked batch's messages
        while self.running:
            batch = await consumer.poll(timeout=1.0)
            if not batch or not self.running:
                continue
            attempt = 1 + max(failed.get((m.topic, m.partition, m.offset), 0) for m in batch) if failed else 1
            with self.lock:  # a stop waits for the batch in hand: handled, then committed or rewound
                nacked = await self._run(batch, None) == "nack"
                if nacked and attempt < policy.max_attempts:
                    failed = {(m.topic, m.partition, m.offset): attempt for m in batch}
                    await consumer.rewind()
                else:
                    if nacked and not await self._dead_letter_batch(batch, attempt):
                        self._outer_config.logger.log(
                            f"{self.topic} group {self.group}: a batch from {batch[0].partition}@"
                            f"{batch[0].offset} was nacked {attempt} times and there is no dead_letter "
                            "topic; stopped before it",
                            logging.CRITICAL,
                        )
                        return
                    failed = {}
                    try:
                        await consumer.commit()
                    except _bus.StaleGenerationError:
                        await consumer.rewind()  # partitions moved: their new owner reads from the commit
                    continue
            await asyncio.sleep(policy.delay(attempt))

    async def _dead_letter_batch(self, batch: Sequence[Message], attempts: int) -> bool:
        """Publish every message of a batch to the dead-letter topic (created if missing), as a group does."""
        if self._dead_letter is None:
            return False
        connection = self._outer_config.connection
        try:
            info = await connection.topic(self._dead_letter)
        except _bus.TopicNotFoundError:
            await connection.create_topic(self._dead_letter, partitions=None)
            info = await connection.topic(self._dead_letter)
        error = f"batch nacked by its handler ({attempts} attempts)"
        await connection.publish_many(
            self._dead_letter,
            [
                Outgoing(
                    m.payload if m.payload is not None else b"",
                    key=m.key,
                    partition=m.partition if info.dynamic else None,
                    headers={
                        **m.headers,
                        "bus.error": error,
                        "bus.attempts": str(attempts),
                        "bus.source.topic": m.topic,
                        "bus.source.partition": m.partition,
                        "bus.source.offset": str(m.offset),
                        "bus.group": self.group or "",
                    },
                )
                for m in batch
            ],
        )
        return True

    async def _queue_loop(self) -> None:
        """Take jobs, hand each to the pipeline in turn, then ack the handled ones in one statement.

        An ack is written after its handler returned, as the bus's own `ack_many` does for a batch: a
        crash before it gives the jobs back after their visibility timeout (at-least-once). The acks
        go out before the next take, and sooner when the jobs in hand have held their lease for a
        quarter of the visibility timeout, so a slow handler never lets a finished job's lease run out.
        """
        queue = self._queue
        assert queue is not None
        loop = asyncio.get_running_loop()
        while self.running:
            taken = await queue.take(max_messages=_TAKE, timeout=1.0)
            due = loop.time() + self._visibility / 4
            for raw in taken:
                await self._run(raw, queue)
                if self._acks and loop.time() >= due:
                    await self._write_acks(queue)
            await self._write_acks(queue)

    async def _write_acks(self, queue: QueueConsumer) -> None:
        """Ack the handled jobs in one statement; a failed ack is logged as FastStream logs one."""
        if not self._acks:
            return
        acks = list(self._acks)
        self._acks.clear()
        try:
            await queue.ack_many(acks)
        except Exception as exc:  # a lease lost meanwhile: the job comes again, as after any lost ack
            self._outer_config.logger.log(repr(exc), logging.CRITICAL, exc_info=exc)

    async def _run(self, raw: Any, queue: QueueConsumer | None) -> str:
        verdicts: list[str] = []
        # Acks wait for the take's statement only when the ack policy writes them after the handler;
        # ACK_FIRST and MANUAL acks are written when they are made.
        deferred = queue is not None and self.ack_policy in _ACK_AFTER
        _current.set((queue, verdicts, self._acks if deferred else None))
        await self.consume(raw)
        return verdicts[-1] if verdicts else "ack"
