"""The Notifier: one LISTEN connection per Bus, fanning NOTIFYs out to actors.

Notifications are hints, never the only path: every subscriber also polls
on a timer, so a notification lost while the connection was down (or
dropped because a mailbox was full) only delays work by one poll interval.
After a reconnect every subscriber is woken once to catch up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from actors.messages import CheckConnection, Notified, NotifierMessage, Subscribe, Unsubscribe
from actors.runtime import Actor
from storage.logs import get_logger

Connect = Callable[[], Awaitable[asyncpg.Connection]]


class Notifier(Actor[NotifierMessage]):
    """Owns the listening connection and the subscription table."""

    mailbox_size = 10_000

    def __init__(self, connect: Connect, channels: list[str], check_interval: float = 1.0) -> None:
        self._connect = connect
        self._channels = channels
        self._check_interval = check_interval
        self._conn: asyncpg.Connection | None = None
        # channel -> key (None: any) -> [(ref, message)]
        self._subs: dict[str, dict[str | None, list[tuple[Any, Any]]]] = {c: {} for c in channels}
        self._log = get_logger(__name__, actor="notifier")

    async def on_start(self) -> None:
        await self._ensure_connected(wake_all=False)
        self.self_ref.schedule_every(self._check_interval, CheckConnection())

    async def on_stop(self) -> None:
        if self._conn is not None:
            # Our own close is not a lost connection.
            self._conn.remove_termination_listener(self._on_lost)
        if self._conn is not None and not self._conn.is_closed():
            try:
                await self._conn.close(timeout=2)
            except Exception:  # closing a broken connection must not fail the stop
                self._conn.terminate()
        self._conn = None

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: object) -> None:
        # Runs in asyncpg's protocol callback: never block, never raise.
        self.self_ref.signal(Notified(channel, str(payload)))

    def _on_lost(self, _conn: Any) -> None:
        self.self_ref.signal(CheckConnection())

    async def _ensure_connected(self, wake_all: bool) -> None:
        if self._conn is not None and not self._conn.is_closed():
            return
        try:
            conn = await self._connect()
            for channel in self._channels:
                await conn.add_listener(channel, self._on_notify)
            conn.add_termination_listener(self._on_lost)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            self._log.warning("listen_connect_failed", error=str(exc))
            return
        self._conn = conn
        self._log.debug("listening", channels=self._channels)
        if wake_all:
            for by_key in self._subs.values():
                for subs in by_key.values():
                    for ref, message in subs:
                        ref.signal(message)

    async def receive(self, message: Subscribe | Unsubscribe | Notified | CheckConnection) -> None:
        match message:
            case Notified(channel=channel, payload=payload):
                by_key = self._subs.get(channel, {})
                for ref, msg in by_key.get(payload, ()):
                    ref.signal(msg)
                for ref, msg in by_key.get(None, ()):
                    ref.signal(msg)
            case Subscribe(channel=channel, key=key, ref=ref, message=msg):
                self._subs.setdefault(channel, {}).setdefault(key, []).append((ref, msg))
            case Unsubscribe(ref=ref):
                for by_key in self._subs.values():
                    for key in list(by_key):
                        by_key[key] = [(r, m) for r, m in by_key[key] if r is not ref]
                        if not by_key[key]:
                            del by_key[key]
            case CheckConnection():
                await self._ensure_connected(wake_all=True)
