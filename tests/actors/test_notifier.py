"""The Notifier listens to its lazy channel only while something subscribes to it."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from actors import Actor, Message, spawn
from actors.messages import Subscribe, Unsubscribe
from actors.notifier import Notifier


class Rang(Message, frozen=True):
    pass


class Bell(Actor[Rang]):
    def __init__(self, rings: list[Rang]) -> None:
        self._rings = rings

    async def receive(self, message: Rang) -> None:
        self._rings.append(message)


async def _listening(conn: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await conn.fetch("SELECT pg_listening_channels()")}


async def _eventually(check: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_a_lazy_channel_is_listened_to_only_while_subscribed(dsn: str) -> None:
    opened: list[asyncpg.Connection] = []

    async def connect() -> asyncpg.Connection:
        conn = await asyncpg.connect(dsn)
        opened.append(conn)
        return conn

    notifier = spawn(lambda: Notifier(connect, ["busy", "quiet"], lazy=frozenset({"busy"})), "notifier")
    rings: list[Rang] = []
    bell = spawn(lambda: Bell(rings), "bell")
    sender = await asyncpg.connect(dsn)
    try:
        await _eventually(lambda: _true(bool(opened)))
        conn = opened[0]
        # Nobody subscribes to the lazy channel: only the other one is listened to, and a NOTIFY
        # on the lazy one never reaches this process.
        assert await notifier.ask(Unsubscribe(None)) is None  # a round trip: the actor has started
        assert await _listening(conn) == {"quiet"}

        # Asking to subscribe returns once the LISTEN is in place: a NOTIFY right after rings.
        await notifier.ask(Subscribe("busy", "7", bell, Rang(), catch_up=False))
        assert await _listening(conn) == {"busy", "quiet"}
        assert rings == []  # no catch-up wake was asked for
        await sender.execute("SELECT pg_notify('busy', '7')")
        await _eventually(lambda: _true(len(rings) == 1))

        # The last subscriber leaves: the channel is not listened to any more.
        await notifier.ask(Unsubscribe(bell))
        assert await _listening(conn) == {"quiet"}

        # A subscription by tell that starts the LISTEN wakes its subscriber once (catch-up).
        notifier.signal(Subscribe("busy", None, bell, Rang()))
        await _eventually(lambda: _true(len(rings) == 2))
        assert await _listening(conn) == {"busy", "quiet"}
    finally:
        await sender.close()
        await bell.stop()
        await notifier.stop()


async def _true(value: bool) -> bool:
    return value
