"""Who does the work: the actor runtime and, built on it, the bus's system actors."""

from actors.runtime import (
    Actor,
    ActorRef,
    ActorStoppedError,
    AskTimeoutError,
    AsyncioClock,
    Backoff,
    Clock,
    EscalationHandler,
    Message,
    RestartStrategy,
    Supervisor,
    Timer,
    spawn,
)

__all__ = [
    "Actor",
    "ActorRef",
    "ActorStoppedError",
    "AskTimeoutError",
    "AsyncioClock",
    "Backoff",
    "Clock",
    "EscalationHandler",
    "Message",
    "RestartStrategy",
    "Supervisor",
    "Timer",
    "spawn",
]
