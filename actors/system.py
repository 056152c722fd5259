"""The actor system of one Bus: a root supervisor with the Notifier, the
HeartbeatMonitor (which owns the Rebalancers), the IdlePoller (the poll
fallback of every local PartitionWorker) and one Coordinator per local group
member (each owning its PartitionWorkers).

Stopping goes newest first: members leave (committing and releasing) while
the monitor and the notifier still run.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from actors.announcer import Announce, Announcer
from actors.coordinator import Coordinator, MemberSink, MemberSpec
from actors.heartbeat import HeartbeatMonitor, MonitorConfig
from actors.messages import CoordinatorMessage, MonitorMessage, NotifierMessage, PollerMessage, SweepNow
from actors.notifier import Notifier, Subscriptions
from actors.poller import IdlePoller
from actors.runtime import ActorRef, RestartStrategy, Supervisor, TimeSource
from storage.availability import Availability, is_unavailable
from storage.db import Lender
from storage.logs import get_logger

log = get_logger(__name__)

#: The actors every user of a Bus depends on (the others belong to one consumer each).
SYSTEM_ACTORS = frozenset(
    {"notifier", "announcer", "heartbeat", "poller", "producer", "cleaner", "scheduler"}
)


class GroupSystem:
    """Starts and stops the system actors of one Bus; spawns members."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        lender: Lender,
        listen: Callable[[], Awaitable[asyncpg.Connection]] | None,
        notify: Callable[[], Awaitable[asyncpg.Connection]],
        monitor_config: MonitorConfig,
        messages_channel: str,
        availability: Availability | None = None,
        clock: TimeSource | None = None,
    ) -> None:
        self._pool = pool
        self._lender = lender
        self._listen = listen  # None: no LISTEN (a transaction pooler without a direct DSN): readers poll
        self._notify = notify
        self.monitor_config = monitor_config
        self.messages_channel = messages_channel
        self._names = itertools.count()
        self._errors: list[tuple[str, BaseException]] = []
        #: Whether the database is reachable, told by the Notifier and the HeartbeatMonitor.
        self.availability = availability if availability is not None else Availability()
        # An actor that fails because the database is away restarts for as long as the outage lasts
        # (backoff 0.1 s doubling to 5 s, jittered); only other failures count toward a give-up.
        self.root = Supervisor(
            "bus",
            on_escalate=self._escalated,
            strategy=RestartStrategy(max_restarts=5, within=30.0, backoff_initial=0.1, backoff_max=5.0),
            outage=is_unavailable,
            clock=clock,  # every actor of the Bus runs its timers on the Bus's time
        )
        self.notifier: ActorRef[NotifierMessage] | None = None
        self.monitor: ActorRef[MonitorMessage] | None = None
        self.announcer: ActorRef[Any] | None = None
        self.poller: ActorRef[PollerMessage] | None = None

    @property
    def errors(self) -> list[tuple[str, BaseException]]:
        """The Bus-wide actors that failed for good, with their last exception (health reads it).

        A group member's Coordinator or a queue consumer's waker that gave up is its consumer's
        error, raised to whoever uses it; these are the ones every consumer of the Bus needs.
        """
        return [(name, exc) for name, exc in self._errors if name in SYSTEM_ACTORS]

    def _escalated(self, child: str, exc: BaseException) -> None:
        self._errors.append((child, exc))
        log.error("system_actor_failed", actor=child, error=repr(exc))

    async def start(self) -> None:
        cfg = self.monitor_config
        table: Subscriptions = {}  # the Notifier's subscriptions, kept across its restarts
        self.notifier = self.root.spawn(
            lambda: Notifier(
                self._listen,
                [self.messages_channel, cfg.groups_channel, cfg.topics_channel],
                lazy=frozenset({self.messages_channel}),
                availability=self.availability,
                table=table,
            ),
            "notifier",
        )
        self.announcer = self.root.spawn(lambda: Announcer(self._notify, self.messages_channel), "announcer")
        notifier = self.notifier
        self.monitor = self.root.spawn(
            lambda: HeartbeatMonitor(cfg, self._pool, notifier, self._notify, self.availability), "heartbeat"
        )
        lender = self._lender
        self.poller = self.root.spawn(lambda: IdlePoller(lender, cfg.now), "poller")

    def spawn_member(self, spec: MemberSpec, sink: MemberSink) -> ActorRef[CoordinatorMessage]:
        """Start a Coordinator for a new local member of `spec.group`."""
        assert self.notifier is not None and self.monitor is not None and self.poller is not None
        notifier, monitor, poller = self.notifier, self.monitor, self.poller
        return self.root.spawn(
            lambda: Coordinator(spec, self._pool, self._lender, sink, notifier, monitor, poller),
            f"coordinator-{spec.group}-{next(self._names)}",
        )

    def announce(self, partition_id: int) -> None:
        """Wake the readers of a partition whose publish just committed (best effort)."""
        if self.announcer is not None:
            self.announcer.signal(Announce(partition_id))

    async def sweep(self) -> int:
        """Run the dead-member and dead-group sweep now; the number of members removed."""
        assert self.monitor is not None
        return int(await self.monitor.ask(SweepNow(), timeout=30.0))

    async def stop(self) -> None:
        await self.root.stop()
        self.availability.close()
