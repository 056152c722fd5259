"""The HeartbeatMonitor: one per Bus.

Every `heartbeat_interval` it writes ONE statement for all local members of
all groups (their heartbeats, their leases, their groups' liveness) and reads
back each group's generation and leader: a newer generation tells the
member's Coordinator to resync; a member missing from the answer was removed
(its session expired while the process was paused) and must join again.
It then sweeps members whose session expired in any process, and marks
groups with no live member for `group_heartbeat_timeout` as dead.

It also owns the Rebalancers: one for each group whose leader is a local
member, started and stopped as leadership moves.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from actors.messages import (
    Beat,
    CoordinatorMessage,
    HeartbeatReply,
    LeaderSeen,
    MemberFenced,
    MonitorMessage,
    NotifierMessage,
    RebalancerMessage,
    RegisterMember,
    SetLeader,
    SweepNow,
    UnregisterMember,
)
from actors.rebalancer import Rebalancer
from actors.runtime import Actor, ActorRef, Supervisor
from storage import membership, retention
from storage.availability import Availability, is_unavailable, warn_unless_said
from storage.db import CONNECTION_ERRORS, TRANSIENT_ERRORS, Now, server_clock
from storage.logs import get_logger


@dataclass(frozen=True)
class MonitorConfig:
    heartbeat_interval: float
    lease_time: float
    rebalance_delay: float
    group_heartbeat_timeout: float
    max_poll_interval: float
    groups_channel: str
    topics_channel: str
    # The time sessions and leases are written and judged at (the Bus's; a test's Clock moves it).
    # A Bus in another process keeps its own: its sweep judges this one's members by real time.
    now: Now = server_clock


class HeartbeatMonitor(Actor[MonitorMessage]):
    """Batched heartbeats, session sweeps, dead groups, and the local Rebalancers."""

    mailbox_size = 1024

    def __init__(
        self,
        config: MonitorConfig,
        pool: asyncpg.Pool,
        notifier: ActorRef[NotifierMessage],
        connect: Callable[[], Awaitable[asyncpg.Connection]],
        availability: Availability | None = None,
    ) -> None:
        self.config = config
        # Told when the own connection cannot be opened (the server is away) and when a sweep
        # succeeds again: the outage detector of a Bus that does not LISTEN.
        self._availability = availability if availability is not None else Availability()
        self._pool = pool
        # The beat's and the sweep's own connection (`connect`). A process's workers, takeovers
        # and rebalances may hold every pool connection for a while (a large group on a small pool, a
        # busy machine); a beat queued behind them would let the members' sessions run out.
        self._connect = connect
        self._conn: asyncpg.Connection | None = None
        self._notifier = notifier
        self._members: dict[tuple[str, str], ActorRef[CoordinatorMessage]] = {}
        self._rebalancers: dict[str, tuple[str, ActorRef[RebalancerMessage]]] = {}
        # Rebalancers being stopped (see _leadership); a successor may start meanwhile, so names are numbered.
        self._stopping: set[ActorRef[RebalancerMessage]] = set()
        self._rebalancer_names = itertools.count()
        self._supervisor: Supervisor | None = None
        self._log = get_logger(__name__, actor="heartbeat")

    async def on_start(self) -> None:
        self._supervisor = Supervisor("rebalancers", outage=is_unavailable, clock=self.clock)
        self.self_ref.schedule_every(self.config.heartbeat_interval, Beat())

    async def on_stop(self) -> None:
        if self._stopping:
            stopping, self._stopping = self._stopping, set()
            await asyncio.gather(*(ref.join() for ref in stopping), return_exceptions=True)
        if self._supervisor is not None:
            await self._supervisor.stop()
        await self._close_connection()

    async def on_failure(self, exc: BaseException) -> None:
        await self._close_connection()

    async def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), 2.0)
            except Exception:  # noqa: BLE001 - closing a connection that may be dead: it goes anyway
                conn.terminate()

    async def receive(self, message: MonitorMessage) -> Any:
        match message:
            case RegisterMember(group=group, member_id=member_id, coordinator=ref):
                self._members[(group, member_id)] = ref
            case UnregisterMember(group=group, member_id=member_id):
                self._members.pop((group, member_id), None)
                await self._leadership(group, None)
            case LeaderSeen(group=group, leader=leader):
                await self._leadership(group, leader)
            case Beat():
                await self._beat()
                await self._sweep()
            case SweepNow():
                return await self._sweep()
        return None

    async def _beat(self) -> None:
        if not self._members:
            return
        keys = list(self._members)
        try:
            rows = await self._heartbeat(keys)
        except TRANSIENT_ERRORS as exc:
            # Missing a beat is survivable (the session is longer); the next one retries.
            self._failed("heartbeat_failed", exc)
            return
        seen = set()
        for row in rows:
            key = (row["group_name"], row["member_id"])
            seen.add(key)
            ref = self._members.get(key)
            if ref is not None:
                ref.signal(
                    HeartbeatReply(
                        row["member_generation"], row["group_generation"], row["leader"], row["state"]
                    )
                )
            await self._leadership(row["group_name"], row["leader"])
        for key in keys:
            if key not in seen and key in self._members:
                self._members[key].signal(MemberFenced(key[1]))

    async def _heartbeat(self, keys: list[tuple[str, str]]) -> list[asyncpg.Record]:
        args = ([g for g, _ in keys], [m for _, m in keys], self.config.lease_time, self.config.now())
        return await self._heartbeat_on_own_connection(args)

    async def _own_connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            try:
                self._conn = await self._connect()
            except TRANSIENT_ERRORS as exc:
                if is_unavailable(exc):
                    self._availability.lost(exc)
                raise
        return self._conn

    def _failed(self, event: str, exc: BaseException) -> None:
        """A beat or sweep failed: a warning, unless the database is away (the Availability says that once)."""
        warn_unless_said(self._log, event, exc)

    async def _heartbeat_on_own_connection(self, args: tuple[Any, ...]) -> list[asyncpg.Record]:
        """Beat on the monitor's own connection, opened on first use and again after it dropped."""
        for attempt in (1, 2):
            conn = await self._own_connection()
            try:
                return await membership.heartbeat(conn, *args)
            except CONNECTION_ERRORS:
                # The server restarted or the backend was terminated: beat again on a new connection.
                conn.terminate()
                self._conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _sweep(self) -> int:
        try:
            # On the beat's connection: a taken pool must not hold up the beats.
            conn = await self._own_connection()
            gone = await membership.sweep(
                conn, self.config.rebalance_delay, self.config.groups_channel, self.config.now()
            )
            dead = await retention.mark_dead_groups(conn, self.config.group_heartbeat_timeout)
        except TRANSIENT_ERRORS as exc:  # a closed own connection is opened again on next use
            self._failed("sweep_failed", exc)
            return 0
        self._availability.reached()
        for group, member in gone:
            self._log.info("member_expired", group=group, member=member)
        for group in dead:
            self._log.info("group_dead", group=group)
        if gone:
            # Leadership may have moved to one of ours: look now, not a beat later.
            await self._beat()
        return len(gone)

    async def _leadership(self, group: str, leader: str | None) -> None:
        local = leader is not None and (group, leader) in self._members
        current = self._rebalancers.get(group)
        if local and leader is not None:
            if current is None:
                self._start_rebalancer(group, leader)
            elif current[0] != leader:
                self._rebalancers[group] = (leader, current[1])
                current[1].signal(SetLeader(leader))
        elif current is not None and (leader is not None or not any(g == group for g, _ in self._members)):
            del self._rebalancers[group]
            # Not awaited: stopping waits for the rebalance in hand, which may wait on the
            # database for seconds after an outage; this actor must keep beating meanwhile
            # or every local member's session runs out. (Rebalances lock the group row, so
            # a successor starting before it ended is harmless.)
            current[1].request_stop(drain=False)
            self._stopping = {ref for ref in self._stopping if ref.is_alive}
            self._stopping.add(current[1])

    def _start_rebalancer(self, group: str, leader: str) -> None:
        assert self._supervisor is not None
        check = max(0.05, min(self.config.rebalance_delay / 2, 0.25))
        ref = self._supervisor.spawn(
            lambda: Rebalancer(
                group,
                leader,
                self._pool,
                self._notifier,
                groups_channel=self.config.groups_channel,
                topics_channel=self.config.topics_channel,
                check_interval=check,
                now=self.config.now,
            ),
            f"rebalancer-{group}-{next(self._rebalancer_names)}",
        )
        self._rebalancers[group] = (leader, ref)
