"""`BusPublishCommand`: FastStream's publish command with the bus's key, partition and idempotency key."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from faststream.response.publish_type import PublishType
from faststream.response.response import BatchPublishCommand, PublishCommand

if TYPE_CHECKING:
    from bus.faststream._compat import SendableMessage


class BusPublishCommand(BatchPublishCommand):
    """A publish to a bus topic: FastStream's command with the bus's key, partition and idempotency key."""

    def __init__(
        self,
        message: SendableMessage,
        /,
        *messages: SendableMessage,
        topic: str = "",
        key: str | None = None,
        partition: str | int | None = None,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        headers: dict[str, Any] | None = None,
        reply_to: str = "",
        timeout: float | None = 30.0,
        _publish_type: PublishType,
    ) -> None:
        super().__init__(
            message,
            *messages,
            destination=topic,
            correlation_id=correlation_id,
            headers=headers,
            reply_to=reply_to,
            _publish_type=_publish_type,
        )
        self.key = key
        self.partition = partition
        self.idempotency_key = idempotency_key
        self.timeout = timeout

    @classmethod
    def from_cmd(cls, cmd: PublishCommand, *, batch: bool = False) -> BusPublishCommand:
        if isinstance(cmd, BusPublishCommand):
            return cmd
        body, extra = cls._parse_bodies(cmd.body, batch=batch)
        return cls(
            body,
            *extra,
            topic=cmd.destination,
            correlation_id=cmd.correlation_id,
            headers=cmd.headers,
            reply_to=cmd.reply_to,
            _publish_type=cmd.publish_type,
        )
