"""The errors of the public API (defined in `storage.errors`, re-exported here)."""

from storage.errors import (
    ActorStoppedError,
    BusError,
    ConcurrentAppendError,
    GroupHasMembersError,
    GroupNotFoundError,
    GroupStoppedError,
    JobFailedError,
    LeaseLostError,
    OffsetOutOfRangeError,
    RebalanceInProgressError,
    SchemaVersionError,
    StaleGenerationError,
    StorageUnavailableError,
    TopicConflictError,
    TopicNotFoundError,
    ValidationError,
)

__all__ = [
    "ActorStoppedError",
    "BusError",
    "ConcurrentAppendError",
    "GroupHasMembersError",
    "GroupNotFoundError",
    "GroupStoppedError",
    "JobFailedError",
    "LeaseLostError",
    "OffsetOutOfRangeError",
    "RebalanceInProgressError",
    "SchemaVersionError",
    "StaleGenerationError",
    "StorageUnavailableError",
    "TopicConflictError",
    "TopicNotFoundError",
    "ValidationError",
]
