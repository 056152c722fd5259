"""An asyncio, actor-based message bus backed by PostgreSQL.

import bus

async with bus.connect() as b:
    await b.create_topic("orders", partitions=8)
    await b.publish("orders", {"id": 1}, key="cust-1")
"""

from bus.admin import (
    Admin,
    GroupDescription,
    GroupSummary,
    MemberInfo,
    PartitionLag,
    ResetRow,
    SubscriptionInfo,
)
from bus.claims import Claim
from bus.client import Bus, connect
from bus.config import Config
from bus.consumer import Consumer, Retry, Subscription
from bus.errors import (
    BusError,
    ConcurrentAppendError,
    GroupHasMembersError,
    GroupNotFoundError,
    GroupStoppedError,
    LeaseLostError,
    OffsetOutOfRangeError,
    RebalanceInProgressError,
    StaleGenerationError,
    StorageUnavailableError,
    TopicConflictError,
    TopicNotFoundError,
    ValidationError,
)
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
from bus.types import Message, Outgoing, PartitionStats, Record, TopicInfo, TopicPartition

__all__ = [
    "Claim",
    "QueueConsumer",
    "Admin",
    "Consumer",
    "GroupDescription",
    "GroupSummary",
    "MemberInfo",
    "PartitionLag",
    "ResetRow",
    "Retry",
    "Subscription",
    "SubscriptionInfo",
    "Bus",
    "BusError",
    "ConcurrentAppendError",
    "Config",
    "GroupHasMembersError",
    "GroupNotFoundError",
    "GroupStoppedError",
    "LeaseLostError",
    "Message",
    "OffsetOutOfRangeError",
    "Outgoing",
    "PartitionStats",
    "RebalanceInProgressError",
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
]
