"""The Rebalancer: one per group, running only in the process that hosts the group's leader member.

Membership changes only mark a rebalance as due (`rebalance_due_at`); this
actor waits until it is due, so a burst of joins and leaves becomes one
rebalance, then computes the assignment with the group's assignor and writes
generation and every member's assignment in one transaction. It also notices
new partitions (dynamic topics) and new topics matching the group's labels,
and marks the group stable once every moved partition has been taken over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from actors import metrics
from actors.assignors import Member, Partition, assign
from actors.messages import (
    NotifierMessage,
    RebalanceCheck,
    RebalancerMessage,
    SetLeader,
    Subscribe,
    Unsubscribe,
)
from actors.runtime import Actor, ActorRef, Timer
from storage import groups as group_sql
from storage import membership
from storage.availability import warn_unless_said
from storage.db import TRANSIENT_ERRORS, Now, server_clock
from storage.logs import get_logger

FINGERPRINT_EVERY = 4  # checks between looks for new partitions/topics
# While moved partitions are being taken over: how soon to look again whether they all are (seconds),
# growing by HANDOVER_GROWTH after each look that finds the handover going on, up to the check
# interval. A handover ends in a few round trips, or in the time the slowest revoking member needs
# (a second or so on a busy machine): the group reads `stable` within about 0.1 s of its end through
# its first second, without a look every 0.05 s for as long as a slow handover lasts.
HANDOVER_CHECK = 0.05
HANDOVER_GROWTH = 1.25


def compute_assignment(
    members: Sequence[asyncpg.Record], parts: Sequence[asyncpg.Record], assignor: str
) -> dict[str, list[int]]:
    """Adapt database rows to the pure assignors."""
    return assign(
        assignor,
        [Member(m["member_id"], tuple(m["topics"]), frozenset(m["assignment"])) for m in members],
        [Partition.of(p["id"], p["topic"], p["name"]) for p in parts],
    )


class Rebalancer(Actor[RebalancerMessage]):
    """Debounces membership changes and writes assignments for one group."""

    mailbox_size = 64

    def __init__(
        self,
        group: str,
        leader_id: str,
        pool: asyncpg.Pool,
        notifier: ActorRef[NotifierMessage],
        *,
        groups_channel: str,
        topics_channel: str,
        check_interval: float,
        now: Now = server_clock,
    ) -> None:
        self.group = group
        self.leader_id = leader_id
        self._pool = pool
        self._notifier = notifier
        self._groups_channel = groups_channel
        self._topics_channel = topics_channel
        self._check_interval = check_interval
        self._now = now  # the time sessions and leases are judged by (the Bus's)
        self._fingerprint: tuple[int, int, int] | None = None
        self._checks = 0
        self._timer: Timer | None = None
        self._handover_wait = HANDOVER_CHECK
        self._log = get_logger(__name__, group=group, leader=leader_id)

    async def on_start(self) -> None:
        ref = self.self_ref
        self._notifier.signal(Subscribe(self._groups_channel, self.group, ref, RebalanceCheck()))
        self._notifier.signal(Subscribe(self._topics_channel, None, ref, RebalanceCheck(discover=True)))
        ref.schedule_every(self._check_interval, RebalanceCheck())
        ref.signal(RebalanceCheck())
        self._log.debug("rebalancer_active")

    async def on_stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._notifier.signal(Unsubscribe(self.self_ref))

    async def receive(self, message: RebalanceCheck | SetLeader) -> None:
        match message:
            case SetLeader(member_id=member_id):
                self.leader_id = member_id
                self.self_ref.signal(RebalanceCheck())
            case RebalanceCheck(discover=discover):
                try:
                    await self._check(discover)
                except TRANSIENT_ERRORS as exc:
                    warn_unless_said(self._log, "rebalance_retry_later", exc)

    async def _check(self, discover: bool) -> None:
        self._checks += 1
        if discover or self._fingerprint is None or self._checks % FINGERPRINT_EVERY == 0:
            await self._look_for_new_partitions()
        row = await group_sql.get_group(self._pool, self.group)
        if row is None:
            return
        if row["rebalance_due_at"] is not None:
            async with self._pool.acquire() as conn:
                outcome = await membership.rebalance(
                    conn,
                    membership.RebalanceParams(
                        group=self.group,
                        leader_id=self.leader_id,
                        channel=self._groups_channel,
                        now=self._now(),
                    ),
                    compute_assignment,
                )
            if outcome.ran:
                self._log.info("rebalanced", generation=outcome.generation, moved=outcome.moved)
                metrics.rebalanced(self.group, outcome.moved)
                if outcome.moved:
                    self._handover_wait = HANDOVER_CHECK
                    self._look_again(HANDOVER_CHECK)
            elif outcome.reason == "not due":
                self._wake_when_due(row["rebalance_due_at"])
        elif row["state"] == "rebalancing":
            if not await membership.mark_stable(self._pool, self.group, row["generation"], self._now()):
                self._look_again(min(self._handover_wait, self._check_interval))
                self._handover_wait *= HANDOVER_GROWTH

    def _wake_when_due(self, due: Any) -> None:
        import datetime as dt

        delay = max(0.0, (due - dt.datetime.now(dt.UTC)).total_seconds()) + 0.005
        self._look_again(min(delay, self._check_interval))

    def _look_again(self, delay: float) -> None:
        """One extra check `delay` seconds from now (replacing the one pending)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.self_ref.schedule_once(delay, RebalanceCheck())

    async def _look_for_new_partitions(self) -> None:
        await group_sql.add_matching_topics(self._pool, self.group)
        fp = await membership.partition_fingerprint(self._pool, self.group)
        if self._fingerprint is not None and fp != self._fingerprint:
            self._log.info("partitions_changed", count=fp[0])
            await membership.request_rebalance(self._pool, self.group, 0.0)
        self._fingerprint = fp
