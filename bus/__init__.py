"""An asyncio, actor-based message bus backed by PostgreSQL.

import bus

async with bus.connect() as b:
    await b.create_topic("orders", partitions=8)
    await b.publish("orders", {"id": 1}, key="cust-1")
"""

from typing import TYPE_CHECKING, Any

from bus.config import Config
from bus.errors import (
    ActorStoppedError,
    BusError,
    ConcurrentAppendError,
    ConfigurationError,
    GroupHasMembersError,
    GroupNotFoundError,
    GroupStoppedError,
    JobFailedError,
    LeaseLostError,
    MessageDecodeError,
    OffsetOutOfRangeError,
    RebalanceInProgressError,
    StaleGenerationError,
    StorageUnavailableError,
    TopicConflictError,
    TopicNotFoundError,
    ValidationError,
)
from bus.types import (
    Health,
    JobGroup,
    JobStatus,
    Message,
    Outgoing,
    PartitionStats,
    Rate,
    Record,
    TopicInfo,
    TopicPartition,
    Unique,
)

# What `import bus` loads is the names: errors, configuration and message types. The Bus and the
# database driver load with the first `bus.connect` (or `bus.Bus`); consumer groups, claims, queues,
# the event store and admin, which only some services use (and the pytest plugin, loaded in every
# pytest run, needs none of them), on the first use of one of their names (`bus.EventStore`,
# `b.subscribe(...)`).
_LAZY = {
    "Bus": "bus.client",
    "connect": "bus.client",
    "Admin": "bus.admin",
    "GroupDescription": "bus.admin",
    "GroupSummary": "bus.admin",
    "MemberInfo": "bus.admin",
    "PartitionLag": "bus.admin",
    "PartitionDepth": "bus.admin",
    "QueueDepth": "bus.admin",
    "ResetRow": "bus.admin",
    "SubscriptionInfo": "bus.admin",
    "Consumer": "bus.consumer",
    "Retry": "bus.consumer",
    "Subscription": "bus.consumer",
    "Transaction": "bus.transaction",
    "Claim": "bus.claims",
    "QueueConsumer": "bus.queues",
    "Worker": "bus.worker",
    "Event": "bus.eventstore",
    "EventClaim": "bus.eventstore",
    "EventStore": "bus.eventstore",
    "Guard": "bus.eventstore",
    "PartitionCursor": "bus.eventstore",
    "PositionedEvent": "bus.eventstore",
    "QueryCondition": "bus.eventstore",
    "ScheduleInfo": "bus.schedules",
    "WorkflowContext": "bus.workflows.context",
    "WorkflowTransaction": "bus.workflows.context",
    "WorkflowHandle": "bus.workflows.engine",
    "WorkflowInfo": "bus.workflows.types",
    "StepInfo": "bus.workflows.types",
}

if TYPE_CHECKING:
    from bus.admin import (
        Admin,
        GroupDescription,
        GroupSummary,
        MemberInfo,
        PartitionDepth,
        PartitionLag,
        QueueDepth,
        ResetRow,
        SubscriptionInfo,
    )
    from bus.claims import Claim
    from bus.client import Bus, connect
    from bus.consumer import Consumer, Retry, Subscription
    from bus.eventstore import (
        Event,
        EventClaim,
        EventStore,
        Guard,
        PartitionCursor,
        PositionedEvent,
        QueryCondition,
    )
    from bus.queues import QueueConsumer
    from bus.schedules import ScheduleInfo
    from bus.transaction import Transaction
    from bus.worker import Worker
    from bus.workflows.context import WorkflowContext, WorkflowTransaction
    from bus.workflows.engine import WorkflowHandle
    from bus.workflows.types import StepInfo, WorkflowInfo


def __getattr__(name: str) -> Any:
    """The names of `_LAZY`, and the package's modules (`bus.eventstore`), imported when first asked for."""
    import importlib

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"bus.{name}")  # importing a module sets it on the package
        except ModuleNotFoundError as exc:
            if exc.name != f"bus.{name}":
                raise
    raise AttributeError(f"module 'bus' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Claim",
    "QueueConsumer",
    "Worker",
    "Admin",
    "Consumer",
    "GroupDescription",
    "GroupSummary",
    "MemberInfo",
    "PartitionDepth",
    "PartitionLag",
    "QueueDepth",
    "ResetRow",
    "Retry",
    "Subscription",
    "SubscriptionInfo",
    "ActorStoppedError",
    "Transaction",
    "Bus",
    "BusError",
    "ConcurrentAppendError",
    "Config",
    "ConfigurationError",
    "GroupHasMembersError",
    "GroupNotFoundError",
    "GroupStoppedError",
    "Health",
    "JobFailedError",
    "LeaseLostError",
    "Message",
    "MessageDecodeError",
    "OffsetOutOfRangeError",
    "Outgoing",
    "PartitionStats",
    "RebalanceInProgressError",
    "Rate",
    "Unique",
    "JobStatus",
    "JobGroup",
    "Record",
    "StaleGenerationError",
    "StorageUnavailableError",
    "TopicConflictError",
    "TopicInfo",
    "TopicNotFoundError",
    "ScheduleInfo",
    "TopicPartition",
    "ValidationError",
    "connect",
    "Event",
    "EventClaim",
    "EventStore",
    "Guard",
    "PartitionCursor",
    "PositionedEvent",
    "QueryCondition",
    "StepInfo",
    "WorkflowContext",
    "WorkflowHandle",
    "WorkflowInfo",
    "WorkflowTransaction",
]
