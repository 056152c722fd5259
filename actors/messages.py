"""Typed messages of the group actors (Coordinator, HeartbeatMonitor, Rebalancer, PartitionWorker, Notifier).

In-process only: fields that carry an ActorRef or a sink are typed `Any`
because those are never encoded.
"""

from __future__ import annotations

from typing import Any

from actors.runtime import Message

# --- Notifier -------------------------------------------------------------------


class Subscribe(Message, frozen=True):
    """Tell `ref` `message` whenever `channel` is notified with `key` (None: any payload).

    `catch_up`: when this subscription starts the LISTEN, tell `ref` once right
    away (what was notified before it). A subscriber that asks instead of
    telling has the LISTEN in place when the answer comes, and needs none.
    """

    channel: str
    key: str | None
    ref: Any
    message: Any
    catch_up: bool = True


class Unsubscribe(Message, frozen=True):
    """Forget every subscription of `ref`."""

    ref: Any


class Notified(Message, frozen=True):
    """A NOTIFY arrived on the listening connection."""

    channel: str
    payload: str


class CheckConnection(Message, frozen=True):
    """Periodic: reconnect the listening connection if it was lost."""


# --- HeartbeatMonitor ------------------------------------------------------------


class RegisterMember(Message, frozen=True):
    """A local member to include in the batched heartbeat."""

    group: str
    member_id: str
    coordinator: Any


class UnregisterMember(Message, frozen=True):
    group: str
    member_id: str


class Beat(Message, frozen=True):
    """Periodic: heartbeat every local member, sweep expired sessions, mark dead groups."""


class SweepNow(Message, frozen=True):
    """Run the dead-member and dead-group sweep now (admin.sweep)."""


class LeaderSeen(Message, frozen=True):
    """A coordinator read the group's leader; start or stop the local Rebalancer."""

    group: str
    leader: str | None


# --- Coordinator -----------------------------------------------------------------


class HeartbeatReply(Message, frozen=True):
    """What the batched heartbeat read back for this member."""

    member_generation: int
    group_generation: int
    leader: str | None
    state: str


class MemberFenced(Message, frozen=True):
    """The member's row is gone (session expired while paused): stop everything, join again.

    `member_id` names the identity found gone: several notices about one identity
    may be queued (each heartbeat, each resync), and only the first may make the
    Coordinator join again; the rest arrive after it has a new id and are stale.
    """

    member_id: str = ""


class GroupChanged(Message, frozen=True):
    """A NOTIFY on the group's channel: the assignment may have changed."""


class Sync(Message, frozen=True):
    """Read this member's assignment and start/stop workers to match it."""


class WorkerFailed(Message, frozen=True):
    """A PartitionWorker gave up (supervision escalated)."""

    partition_id: int
    error: str


class LeaseLost(Message, frozen=True):
    """A PartitionWorker found its lease taken: resync."""

    partition_id: int


# --- Rebalancer ------------------------------------------------------------------


class RebalanceCheck(Message, frozen=True):
    """Run a rebalance if one is due; look for new partitions and settled handovers."""

    discover: bool = False  # look for new topics/partitions now (a topic was created)


class SetLeader(Message, frozen=True):
    """The local member that leads the group (the Rebalancer writes as it)."""

    member_id: str


# --- PartitionWorker -------------------------------------------------------------


class Wake(Message, frozen=True):
    """New messages may be there (NOTIFY, poll fallback, or more to fetch)."""


class Seek(Message, frozen=True):
    """Continue from `offset` (buffered messages of the partition are dropped)."""

    offset: int


class RetryDue(Message, frozen=True):
    """A handler's backoff is over: retry the failed message (if the lease of `epoch` is still held)."""

    epoch: int


class CommitDue(Message, frozen=True):
    """Handler mode: the commit interval is over; commit what was handled under the lease of `epoch`."""

    epoch: int


class CheckLease(Message, frozen=True):
    """The poll fallback saw the worker's lease taken or run out: read it, and let go if it is."""


class Rewind(Message, frozen=True):
    """Continue from the group's committed offset (buffered messages of the partition are dropped).

    The answer (to an ask) is True once the worker's position is the committed
    offset, False when the database could not be read (the caller retries).
    """


# --- IdlePoller -------------------------------------------------------------------


class Watch(Message, frozen=True):
    """A PartitionWorker with nothing to do: where it stands, for the poll fallback of its Bus.

    `epoch` None: the worker does not hold the lease yet. `always`: wake it at every poll
    whatever the log holds (it waits to take the lease, or to hand on a batch). A newer
    Watch from the same worker replaces the older.
    """

    ref: Any
    group: str
    member_id: str
    partition_id: int
    epoch: int | None
    position: int
    interval: float
    always: bool = False


class Unwatch(Message, frozen=True):
    """The worker stopped: forget it."""

    ref: Any


class PollDue(Message, frozen=True):
    """Periodic: look, in one statement, which watched partitions have work."""


# -- what each actor receives (its ActorRef's type parameter) --------------------------

NotifierMessage = Subscribe | Unsubscribe | Notified | CheckConnection
MonitorMessage = RegisterMember | UnregisterMember | Beat | SweepNow | LeaderSeen
CoordinatorMessage = HeartbeatReply | MemberFenced | GroupChanged | Sync | WorkerFailed | LeaseLost
RebalancerMessage = RebalanceCheck | SetLeader
WorkerMessage = Wake | Seek | Rewind | RetryDue | CommitDue | CheckLease
PollerMessage = Watch | Unwatch | PollDue
