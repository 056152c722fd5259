"""The logger storage of a BusBroker: FastStream's access log format, with topic and group."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from bus.faststream._compat import DefaultLoggerStorage, get_broker_logger

if TYPE_CHECKING:
    from bus.faststream._compat import LoggerProto


class _LoggerStorage(DefaultLoggerStorage):
    def __init__(self) -> None:
        super().__init__()
        self.logger_log_level = logging.INFO

    def set_level(self, level: int) -> None:
        self.logger_log_level = level

    def register_subscriber(self, params: dict[str, Any]) -> None:
        return None

    def get_logger(self, *, context: Any) -> LoggerProto:
        if not (lg := self._get_logger_ref()):
            lg = get_broker_logger(  # FastStream's own access log format
                name="bus",
                default_context={"topic": "", "group": ""},
                message_id_ln=10,
                fmt="%(asctime)s %(levelname)-8s - %(topic)s | %(group)s | %(message_id)-10s - %(message)s",
                context=context,
                log_level=self.logger_log_level,
            )
            self._logger_ref.add(lg)
        return lg
