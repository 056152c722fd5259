"""What a PartitionWorker is given and what it hands on: its spec, the Sink and the values crossing it.

The worker (actors/worker.py) and its handler-mode runner (actors/handler_runner.py)
both speak these; the Bus implements `Sink` (bus/handoff.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

import asyncpg

from actors.messages import WorkerMessage
from actors.runtime import ActorRef
from storage.db import Now, server_clock
from storage.names import validate_int, validate_seconds


@dataclass(frozen=True)
class Batch:
    """Fetched rows of one partition, tagged with the lease epoch they were read under."""

    topic: str
    partition: str
    partition_id: int
    epoch: int
    rows: list[asyncpg.Record]
    worker: ActorRef[WorkerMessage]


@dataclass(frozen=True)
class RetryPolicy:
    """How a handler failure is retried: `max_attempts` in all, backoff doubling from `backoff` seconds."""

    max_attempts: int = 3
    backoff: float = 0.5
    max_backoff: float = 30.0

    @classmethod
    def checked(
        cls, max_attempts: int, backoff: timedelta | float, max_backoff: timedelta | float
    ) -> RetryPolicy:
        """A policy from user input: ValidationError (saying what to pass) for anything out of range."""
        return cls(
            validate_int(max_attempts, "retry max_attempts", 1),
            validate_seconds(backoff, "retry backoff", allow_zero=True),
            validate_seconds(max_backoff, "retry max_backoff", allow_zero=True),
        )

    def delay(self, attempt: int) -> float:
        return float(min(self.max_backoff, self.backoff * (2 ** (attempt - 1))))


@dataclass(frozen=True)
class TxOutcome:
    """What a transactional handler's batch came to (`Sink.handle_transaction`).

    `committed`: the position committed with the handler's writes (None: the lease
    had moved on, nothing applied). `failed`: the index in the batch of the message
    that failed with `attempts` failed attempts so far (the offsets stop at it);
    `stopped`: its last attempt failed and there is no dead-letter topic.
    """

    committed: int | None
    failed: int | None = None
    attempts: int = 0
    stopped: BaseException | None = None


class Sink(Protocol):
    """Where a worker's messages go: the consumer's buffer (poll) or the user's handler (subscribe)."""

    handler_mode: bool
    transactional: bool
    retry: RetryPolicy

    def acquired(self, partition_id: int, epoch: int, worker: ActorRef[WorkerMessage]) -> None:
        """Poll mode: this worker holds the partition's lease of `epoch` (before any batch of it)."""

    def offer(self, batch: Batch) -> bool:
        """Poll mode: buffer the batch; False when the buffer is full (try again later)."""

    def consumed(self, partition_id: int, epoch: int) -> int | None:
        """Poll mode, auto-commit: the position the user has polled through (None: nothing to commit)."""

    def revoked(self, partition_id: int, epoch: int) -> None:
        """Drop whatever is buffered from this lease."""

    def released(self, partition_id: int, epoch: int, committed: int | None) -> None:
        """Poll mode: the lease ended; `committed` is the position the worker committed as it let go (None: none)."""

    async def handle(self, topic: str, partition: str, row: asyncpg.Record, attempt: int) -> None:
        """Handler mode: process one message (raise to retry)."""

    async def dead_letter(
        self, topic: str, partition: str, row: asyncpg.Record, error: BaseException, attempts: int
    ) -> bool:
        """Handler mode: send to the dead-letter topic; False when there is none."""

    def failed(self, topic: str, partition: str, error: BaseException) -> None:
        """Handler mode: the partition stopped on an error it could not get past."""

    async def handle_transaction(
        self, spec: WorkerSpec, epoch: int, rows: list[asyncpg.Record], now: datetime | None
    ) -> TxOutcome:
        """Transactional handler mode: handle `rows` and commit their offsets in one transaction."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a PartitionWorker needs to know, fixed for its life."""

    group: str
    member_id: str
    generation: int
    topic: str
    partition: str
    partition_id: int
    lease_time: float
    poll_interval: float
    fetch_size: int
    messages_channel: str
    now: Now = server_clock  # the time its lease is taken, renewed and judged at (the Bus's)
