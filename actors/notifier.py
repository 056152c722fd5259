"""The Notifier: one LISTEN connection per Bus, fanning NOTIFYs out to actors.

Notifications are hints, never the only path: every subscriber also polls
on a timer, so a notification lost while the connection was down (or
dropped because a mailbox was full) only delays work by one poll interval.
After a reconnect every subscriber is woken once to catch up.

A server that is away is retried for as long as it is away, never given up
on: the n-th failed attempt in a row waits a capped, jittered backoff
(`RECONNECT`) before the next, meanwhile (un)subscriptions go on in the
table, and the reconnect LISTENs to every wanted channel and wakes every
subscriber, so nothing published during the outage waits for a poll. The
Notifier reports to the Bus's `Availability` (one line when the server
cannot be reached, one when it is back), which `Bus.health()` reads.

A NOTIFY goes from the connection's callback straight into the subscribers'
mailboxes, through `_routes`: an immutable copy of the subscription table
that the Notifier makes in its own turn once a burst of (un)subscriptions is
over (the callback only reads it; the table itself is touched by the
Notifier's task alone). While the copy is stale the callback hands the
notification to the Notifier's mailbox, as every NOTIFY went before; the
direct path saves a turn of the event loop on the way from a commit to the
worker that reads it.

A `lazy` channel (the busy messages channel) is LISTENed to only while some
actor subscribes to it: a process that only publishes receives no
notifications (every NOTIFY costs each listening connection a message to
parse). A subscriber whose subscription started the LISTEN is woken once
right after it (`Subscribe.catch_up`), so nothing notified between its first
read and the LISTEN waits for the poll; one that asks (`ask(Subscribe(...))`)
knows the LISTEN is in place when the answer comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import asyncpg

from actors.messages import CheckConnection, Notified, NotifierMessage, Subscribe, Unsubscribe
from actors.runtime import Actor, Backoff
from storage.availability import Availability, is_unavailable
from storage.db import CONNECTION_ERRORS
from storage.errors import StorageUnavailableError
from storage.logs import get_logger

Connect = Callable[[], Awaitable[asyncpg.Connection]]
#: channel -> key (None: any) -> [(subscriber's ref, the message it gets)]
Subscriptions = dict[str, dict[str | None, list[tuple[Any, Any]]]]

# A LISTEN or UNLISTEN that takes longer than this is given up (the connection is dropped and the
# periodic check reconnects): the Notifier must never hang behind a half-dead connection.
_LISTEN_TIMEOUT = 5.0
_LISTEN_ERRORS: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, asyncpg.PostgresError, TimeoutError)
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (*_LISTEN_ERRORS, StorageUnavailableError)

#: Between failed attempts to open the listening connection: 0.1 s doubling up to 2 s, jittered.
#: A short cap, because this connection is what tells the Bus the server is back: the
#: wake-ups return at most about 2 s after the server does (a refused attempt costs nothing).
RECONNECT = Backoff(initial=0.1, maximum=2.0)


class Notifier(Actor[NotifierMessage]):
    """Owns the listening connection and the subscription table."""

    mailbox_size = 10_000

    def __init__(
        self,
        connect: Connect | None,
        channels: list[str],
        check_interval: float = 1.0,
        lazy: frozenset[str] = frozenset(),
        availability: Availability | None = None,
        reconnect: Backoff = RECONNECT,
        table: Subscriptions | None = None,
    ) -> None:
        self._connect = connect
        self._availability = availability if availability is not None else Availability()
        self._reconnect = reconnect
        self._attempts = 0  # failed attempts to connect in a row
        self._retry_at = 0.0  # the clock's time before which no attempt is made (the backoff)
        self._channels = channels
        self._lazy = lazy
        self._check_interval = check_interval
        self._conn: asyncpg.Connection | None = None
        self._listening: set[str] = set()  # channels LISTENed to on `_conn`
        # channel -> key (None: any) -> [(ref, message)]
        # The subscription table; given by the owner (`table`), it outlives a restart of this actor
        # as its mailbox does, so a restarted Notifier still wakes everyone who subscribed.
        self._subs: Subscriptions = table if table is not None else {}
        for channel in channels:
            self._subs.setdefault(channel, {})
        # What the NOTIFY callback reads: a copy of `_subs` never changed once made; None while stale.
        self._routes: dict[str, dict[str | None, tuple[tuple[Any, Any], ...]]] | None = None
        self._log = get_logger(__name__, actor="notifier")

    async def on_start(self) -> None:
        # A restarted instance finds subscribers in the table: what it missed meanwhile, they look for.
        await self._ensure_connected(wake_all=any(self._subs.values()))
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
        self._listening.clear()

    async def on_failure(self, exc: BaseException) -> None:
        # The instance that replaces this one opens its own connection: this one must not go on
        # listening (its callback would ring every subscriber a second time).
        if self._conn is not None:
            self._conn.remove_termination_listener(self._on_lost)
            self._conn.terminate()
        self._conn = None
        self._listening.clear()

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: object) -> None:
        # Runs as asyncpg's listener callback: never block, never raise (signal never raises).
        routes = self._routes
        if routes is None:  # the table is changing: the Notifier's own turn routes it
            self.self_ref.signal(Notified(channel, str(payload)))
            return
        _ring(routes.get(channel), str(payload))

    def _publish_routes(self) -> None:
        """Make the callback's copy of the table, once no more (un)subscriptions wait in the mailbox."""
        if self._routes is None and not self.self_ref.queued:
            self._routes = {
                channel: {key: tuple(subs) for key, subs in by_key.items()}
                for channel, by_key in self._subs.items()
            }

    def _on_lost(self, _conn: Any) -> None:
        self.self_ref.signal(CheckConnection())

    async def _ensure_connected(self, wake_all: bool) -> None:
        if self._connect is None:  # no LISTEN possible here: subscribers find work by their own polls
            return
        if self._conn is not None and not self._conn.is_closed():
            return
        if self.clock.monotonic() < self._retry_at:
            return  # backing off: a timer brings the next attempt
        self._listening.clear()
        wanted = [c for c in self._channels if c not in self._lazy or self._subs.get(c)]
        conn: asyncpg.Connection | None = None
        try:
            # Bounded: a server that drops packets (a network cut) must not hold up the subscriptions.
            async with asyncio.timeout(_LISTEN_TIMEOUT):
                conn = await self._connect()
            for channel in wanted:
                async with asyncio.timeout(_LISTEN_TIMEOUT):
                    await conn.add_listener(channel, self._on_notify)
            conn.add_termination_listener(self._on_lost)
        except _CONNECT_ERRORS as exc:
            if conn is not None:
                conn.terminate()
            self._failed_attempt(exc)
            return
        recovered = not self._availability.available
        self._conn = conn
        self._attempts = 0
        self._retry_at = 0.0
        self._listening.update(wanted)
        self._availability.reached()
        self._log.debug("listening", channels=wanted)
        if wake_all or recovered:
            # Whatever was notified while nobody listened: every subscriber looks once.
            for by_key in self._subs.values():
                for subs in by_key.values():
                    for ref, message in subs:
                        ref.signal(message)

    def _failed_attempt(self, exc: BaseException) -> None:
        """Back off before the next attempt; a server that is away is an outage (said once), not a failure."""
        self._attempts += 1
        delay = self._reconnect.delay(self._attempts)
        self._retry_at = self.clock.monotonic() + delay
        self.self_ref.schedule_once(delay, CheckConnection())
        if is_unavailable(exc) or isinstance(exc, TimeoutError):  # refused, lost, or no answer at all
            self._availability.lost(exc)
            self._log.debug("listen_connect_failed", error=str(exc), attempt=self._attempts, retry_in=delay)
        else:
            self._log.warning("listen_connect_failed", error=str(exc), attempt=self._attempts, retry_in=delay)

    async def receive(self, message: Subscribe | Unsubscribe | Notified | CheckConnection) -> None:
        if isinstance(message, Subscribe | Unsubscribe):
            self._routes = None  # stale from now until the burst is over
        try:
            await self._receive(message)
        finally:
            self._publish_routes()

    async def _receive(self, message: Subscribe | Unsubscribe | Notified | CheckConnection) -> None:
        match message:
            case Notified(channel=channel, payload=payload):
                _ring(self._subs.get(channel), payload)
            case Subscribe(channel=channel, key=key, ref=ref, message=msg, catch_up=catch_up):
                self._subs.setdefault(channel, {}).setdefault(key, []).append((ref, msg))
                if await self._listen(channel) and catch_up:
                    ref.signal(msg)  # what was notified before the LISTEN: look once
            case Unsubscribe(ref=ref):
                for by_key in self._subs.values():
                    for key in list(by_key):
                        by_key[key] = [(r, m) for r, m in by_key[key] if r is not ref]
                        if not by_key[key]:
                            del by_key[key]
                for channel in [c for c in self._listening & self._lazy if not self._subs.get(c)]:
                    await self._unlisten(channel)
            case CheckConnection():
                await self._ensure_connected(wake_all=True)

    async def _listen(self, channel: str) -> bool:
        """LISTEN to `channel` if not yet; True when this call started it."""
        conn = self._conn
        if channel in self._listening or conn is None or conn.is_closed():
            return False  # listening already, or the reconnect listens (and wakes everyone)
        if not await self._change(conn, conn.add_listener, channel, "listen_failed"):
            return False
        self._listening.add(channel)
        return True

    async def _unlisten(self, channel: str) -> None:
        """Stop listening to `channel` (nobody subscribes to it any more)."""
        self._listening.discard(channel)
        conn = self._conn
        if conn is not None and not conn.is_closed():
            await self._change(conn, conn.remove_listener, channel, "unlisten_failed")

    async def _change(
        self,
        conn: asyncpg.Connection,
        change: Callable[[str, Any], Awaitable[None]],
        channel: str,
        failure: str,
    ) -> bool:
        """Run a LISTEN or UNLISTEN, bounded in time; on any failure drop the connection (False).

        The periodic check then reconnects and listens to every wanted channel.
        """
        try:
            async with asyncio.timeout(_LISTEN_TIMEOUT):
                await change(channel, self._on_notify)
        except _LISTEN_ERRORS as exc:
            self._log.warning(failure, channel=channel, error=repr(exc))
            conn.terminate()
            return False
        return True


def _ring(by_key: Mapping[str | None, Iterable[tuple[Any, Any]]] | None, key: str) -> None:
    """Signal the subscribers of a channel's `key` and those of any key (`by_key`: key -> subscribers)."""
    if not by_key:
        return
    for ref, msg in by_key.get(key, ()):
        ref.signal(msg)
    for ref, msg in by_key.get(None, ()):
        ref.signal(msg)
