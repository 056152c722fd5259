"""The Notifier listens to its lazy channel only while something subscribes to it."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import asyncpg

from actors import Actor, Backoff, Message, Supervisor, spawn
from actors.messages import Notified, Subscribe, Unsubscribe
from actors.notifier import Notifier, Subscriptions
from bus.testing import eventually
from storage import db
from storage.availability import Availability


class Rang(Message, frozen=True):
    pass


class Bell(Actor[Rang]):
    def __init__(self, rings: list[Rang]) -> None:
        self._rings = rings

    async def receive(self, message: Rang) -> None:
        self._rings.append(message)


async def _listening(conn: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await conn.fetch("SELECT pg_listening_channels()")}


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
        await eventually(lambda: bool(opened))
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
        await eventually(lambda: len(rings) == 1)

        # The last subscriber leaves: the channel is not listened to any more.
        await notifier.ask(Unsubscribe(bell))
        assert await _listening(conn) == {"quiet"}

        # A subscription by tell that starts the LISTEN wakes its subscriber once (catch-up).
        notifier.signal(Subscribe("busy", None, bell, Rang()))
        await eventually(lambda: len(rings) == 2)
        assert await _listening(conn) == {"busy", "quiet"}
    finally:
        await sender.close()
        await bell.stop()
        await notifier.stop()


class CountingNotifier(Notifier):
    """A Notifier that counts the notifications its own turns route (the mailbox path)."""

    routed_in_turn = 0

    async def _receive(self, message: Any) -> None:
        if type(message).__name__ == "Notified":
            CountingNotifier.routed_in_turn += 1
        await super()._receive(message)


async def test_a_notify_goes_straight_to_its_subscribers_once_the_table_is_settled(dsn: str) -> None:
    CountingNotifier.routed_in_turn = 0

    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(dsn)

    notifier = spawn(lambda: CountingNotifier(connect, ["chan"]), "notifier")
    seven: list[Rang] = []
    eight: list[Rang] = []
    bell7 = spawn(lambda: Bell(seven), "bell7")
    bell8 = spawn(lambda: Bell(eight), "bell8")
    sender = await asyncpg.connect(dsn)
    try:
        await notifier.ask(Subscribe("chan", "7", bell7, Rang(), catch_up=False))
        await notifier.ask(Subscribe("chan", "8", bell8, Rang(), catch_up=False))
        for key in ("7", "7", "8", "9"):
            await sender.execute("SELECT pg_notify('chan', $1)", key)
        await eventually(lambda: len(seven) == 2 and len(eight) == 1)
        # Routed by the connection's callback from the settled table, not through the mailbox.
        assert CountingNotifier.routed_in_turn == 0

        # A subscriber that leaves is not woken any more; the others still are.
        await notifier.ask(Unsubscribe(bell7))
        await sender.execute("SELECT pg_notify('chan', '7')")
        await sender.execute("SELECT pg_notify('chan', '8')")
        await eventually(lambda: len(eight) == 2)
        await asyncio.sleep(0.1)
        assert len(seven) == 2
        assert CountingNotifier.routed_in_turn == 0
    finally:
        await sender.close()
        await bell7.stop()
        await bell8.stop()
        await notifier.stop()


async def test_a_notify_that_comes_while_the_table_changes_goes_through_the_notifiers_turn(dsn: str) -> None:
    CountingNotifier.routed_in_turn = 0
    opened: list[asyncpg.Connection] = []

    async def connect() -> asyncpg.Connection:
        conn = await asyncpg.connect(dsn)
        opened.append(conn)
        return conn

    notifier = spawn(lambda: CountingNotifier(connect, ["chan"]), "notifier")
    rings: list[Rang] = []
    bell = spawn(lambda: Bell(rings), "bell")
    sender = await asyncpg.connect(dsn)
    try:
        await notifier.ask(Subscribe("chan", "7", bell, Rang(), catch_up=False))
        # A burst of subscriptions is waiting in the mailbox when the NOTIFY comes: the
        # callback does not trust its copy of the table, and the Notifier's turn routes it.
        for _ in range(200):
            notifier.signal(Subscribe("chan", "other", bell, Rang(), catch_up=False))
        await sender.execute("SELECT pg_notify('chan', '7')")
        await eventually(lambda: len(rings) >= 1)
        await notifier.ask(Unsubscribe(None))  # a round trip: the burst is over
        before = CountingNotifier.routed_in_turn
        await sender.execute("SELECT pg_notify('chan', '7')")
        await eventually(lambda: len(rings) >= 2)
        assert CountingNotifier.routed_in_turn == before  # settled again: straight to the bell
    finally:
        await sender.close()
        await bell.stop()
        await notifier.stop()


def _closed_port() -> int:
    """A local port nothing listens on: connecting to it is refused, as to a stopped server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_while_the_server_is_away_the_notifier_answers_and_retries_then_listens_and_wakes_everyone(
    dsn: str, schema: str
) -> None:
    away = f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres"
    attempts: list[str] = []

    async def connect() -> asyncpg.Connection:
        # The server is away for the first four attempts, then back.
        attempts.append("away" if len(attempts) < 4 else "back")
        return await db.connect(away if attempts[-1] == "away" else dsn, schema)

    availability = Availability()
    notifier = spawn(
        lambda: Notifier(
            connect,
            ["busy"],
            availability=availability,
            reconnect=Backoff(initial=0.05, maximum=0.2),
            check_interval=30.0,  # only the backoff's own retries
        ),
        "notifier",
    )
    rings: list[Rang] = []
    bell = spawn(lambda: Bell(rings), "bell")
    sender = await asyncpg.connect(dsn)
    try:
        # The subscription is answered while the server is away: it is in the table.
        await notifier.ask(Subscribe("busy", None, bell, Rang(), catch_up=False))
        assert not availability.available and "cannot connect" in (availability.error or "")
        # Back: listening again, everyone woken once (what was published meanwhile), outage over.
        await eventually(lambda: availability.available, timeout=5)
        assert attempts == ["away", "away", "away", "away", "back"]
        assert availability.outages == 1
        await eventually(lambda: len(rings) == 1)
        await sender.execute("SELECT pg_notify('busy', 'x')")
        await eventually(lambda: len(rings) == 2)
        assert notifier.is_alive
    finally:
        await sender.close()
        await bell.stop()
        await notifier.stop()


class CrashingNotifier(Notifier):
    """A Notifier with a bug: a notification on channel "crash" makes it fail."""

    async def _receive(self, message: Any) -> None:
        if isinstance(message, Notified) and message.channel == "crash":
            raise RuntimeError("a bug in the notifier")
        await super()._receive(message)


async def test_a_restarted_notifier_keeps_its_subscribers_and_wakes_them(dsn: str) -> None:
    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(dsn)

    table: Subscriptions = {}
    sup = Supervisor("test")
    notifier = sup.spawn(lambda: CrashingNotifier(connect, ["busy"], table=table), "notifier")
    rings: list[Rang] = []
    bell = spawn(lambda: Bell(rings), "bell")
    sender = await asyncpg.connect(dsn)
    try:
        await notifier.ask(Subscribe("busy", None, bell, Rang(), catch_up=False))
        notifier.signal(Notified("crash", ""))
        # The new instance listens again and wakes the subscriber it found in the table.
        await eventually(lambda: len(rings) == 1)
        assert notifier.is_alive and not sup.escalated.is_set()
        await notifier.ask(Unsubscribe(None))  # a round trip: the new instance has started
        await sender.execute("SELECT pg_notify('busy', 'x')")
        await eventually(lambda: len(rings) == 2)
    finally:
        await sender.close()
        await bell.stop()
        await sup.stop()
