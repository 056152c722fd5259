"""Who does the work: the actor runtime and, built on it, the bus's system actors."""

from actors.runtime import (
    Actor,
    ActorRef,
    ActorStoppedError,
    AskTimeoutError,
    Backoff,
    EscalationHandler,
    Message,
    RealTime,
    RestartStrategy,
    Supervisor,
    Timer,
    TimeSource,
    spawn,
)
from actors.time_source import BusTime

__all__ = [
    "Actor",
    "ActorRef",
    "ActorStoppedError",
    "AskTimeoutError",
    "Backoff",
    "BusTime",
    "EscalationHandler",
    "Message",
    "RealTime",
    "RestartStrategy",
    "Supervisor",
    "TimeSource",
    "Timer",
    "spawn",
]
