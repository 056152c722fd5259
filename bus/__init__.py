"""An asyncio, actor-based message bus backed by PostgreSQL.

import bus

async with bus.connect() as b:
    await b.create_topic("orders", partitions=8)
    await b.publish("orders", {"id": 1}, key="cust-1")
"""

from typing import TYPE_CHECKING, Any

from bus.config import Config as Config
from bus.errors import ActorStoppedError as ActorStoppedError
from bus.errors import BusError as BusError
from bus.errors import ConcurrentAppendError as ConcurrentAppendError
from bus.errors import ConfigurationError as ConfigurationError
from bus.errors import GroupHasMembersError as GroupHasMembersError
from bus.errors import GroupNotFoundError as GroupNotFoundError
from bus.errors import GroupStoppedError as GroupStoppedError
from bus.errors import JobFailedError as JobFailedError
from bus.errors import LeaseLostError as LeaseLostError
from bus.errors import MessageDecodeError as MessageDecodeError
from bus.errors import OffsetOutOfRangeError as OffsetOutOfRangeError
from bus.errors import RebalanceInProgressError as RebalanceInProgressError
from bus.errors import StaleGenerationError as StaleGenerationError
from bus.errors import StorageUnavailableError as StorageUnavailableError
from bus.errors import TopicConflictError as TopicConflictError
from bus.errors import TopicNotFoundError as TopicNotFoundError
from bus.errors import ValidationError as ValidationError
from bus.types import Health as Health
from bus.types import JobGroup as JobGroup
from bus.types import JobStatus as JobStatus
from bus.types import Message as Message
from bus.types import Outgoing as Outgoing
from bus.types import PartitionStats as PartitionStats
from bus.types import Rate as Rate
from bus.types import Record as Record
from bus.types import TopicInfo as TopicInfo
from bus.types import TopicPartition as TopicPartition
from bus.types import Unique as Unique

# What `import bus` loads is the names: errors, configuration and message types. The Bus and the
# database driver load with the first `bus.connect` (or `bus.Bus`); consumer groups, claims, queues,
# the event store and admin, which only some services use (and the pytest plugin, loaded in every
# pytest run, needs none of them), on the first use of one of their names (`bus.EventStore`,
# `b.subscribe(...)`).
#
# Each public name is written in one of two places: imported above (`X as X`: exported to type
# checkers), or in `_LAZY`, mirrored by the `TYPE_CHECKING` imports below for type checkers
# (tests/api/test_public_names.py keeps the two alike). `__all__` is derived from both.
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

if TYPE_CHECKING:  # `_LAZY` for type checkers
    from bus.admin import Admin as Admin
    from bus.admin import GroupDescription as GroupDescription
    from bus.admin import GroupSummary as GroupSummary
    from bus.admin import MemberInfo as MemberInfo
    from bus.admin import PartitionDepth as PartitionDepth
    from bus.admin import PartitionLag as PartitionLag
    from bus.admin import QueueDepth as QueueDepth
    from bus.admin import ResetRow as ResetRow
    from bus.admin import SubscriptionInfo as SubscriptionInfo
    from bus.claims import Claim as Claim
    from bus.client import Bus as Bus
    from bus.client import connect as connect
    from bus.consumer import Consumer as Consumer
    from bus.consumer import Retry as Retry
    from bus.consumer import Subscription as Subscription
    from bus.eventstore import Event as Event
    from bus.eventstore import EventClaim as EventClaim
    from bus.eventstore import EventStore as EventStore
    from bus.eventstore import Guard as Guard
    from bus.eventstore import PartitionCursor as PartitionCursor
    from bus.eventstore import PositionedEvent as PositionedEvent
    from bus.eventstore import QueryCondition as QueryCondition
    from bus.queues import QueueConsumer as QueueConsumer
    from bus.schedules import ScheduleInfo as ScheduleInfo
    from bus.transaction import Transaction as Transaction
    from bus.worker import Worker as Worker
    from bus.workflows.context import WorkflowContext as WorkflowContext
    from bus.workflows.context import WorkflowTransaction as WorkflowTransaction
    from bus.workflows.engine import WorkflowHandle as WorkflowHandle
    from bus.workflows.types import StepInfo as StepInfo
    from bus.workflows.types import WorkflowInfo as WorkflowInfo


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


if not TYPE_CHECKING:  # type checkers read the imports (`X as X`), which a computed list would hide from them
    __all__ = [
        name
        for name, value in globals().items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").partition(".")[0] in ("bus", "storage")
    ] + list(_LAZY)
