"""The publisher of a handler's reply to the `reply_to` of the request it handled."""

from __future__ import annotations

from typing import Any

from bus.faststream._compat import FakePublisher
from bus.faststream.response import BusPublishCommand


class _ReplyPublisher(FakePublisher):
    def __init__(self, producer: Any, topic: str) -> None:
        super().__init__(producer=producer)
        self.topic = topic

    def patch_command(self, cmd: Any) -> BusPublishCommand:
        cmd = super().patch_command(cmd)
        real = BusPublishCommand.from_cmd(cmd)
        real.destination = self.topic
        return real
