"""What the parts of one Bus share: the context its sub-facades take instead of the Bus.

A consumer, a queue consumer, a claim, an event store, the admin and the metrics
need a handful of the Bus's things: its pool and Lender, its configuration and
channel names, its actor system, the topic lookup and publishing. They get this
object, which holds exactly those, and keeps their per-Bus state (`state`), so
none of them imports `bus.client` and the Bus stays the one place that builds them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from actors.time_source import BusTime
from storage import db

if TYPE_CHECKING:
    import asyncpg

    from actors.system import GroupSystem
    from bus.config import Config
    from bus.types import Outgoing, Record, TopicInfo

__all__ = ["BusContext", "Channels", "Connected", "context_of"]

S = TypeVar("S")


class Channels:
    """LISTEN/NOTIFY channel names of one schema (passed as parameters, never interpolated)."""

    def __init__(self, schema: str) -> None:
        self.messages = f"{schema}.messages"
        self.topics = f"{schema}.topics"
        self.groups = f"{schema}.groups"
        self.results = f"{schema}.results"


class TopicCreate(Protocol):
    async def __call__(
        self, name: str, partitions: int | None = 1, *, semantics: str = "pubsub"
    ) -> TopicInfo: ...


class PublishMany(Protocol):
    async def __call__(
        self, topic: str, messages: Sequence[Outgoing | Any], *, connection: asyncpg.Connection | None = None
    ) -> list[Record]: ...


class BusContext:
    """The pool, Lender, config, channels, actor system, topic lookup and publishing of one Bus.

    `topic`, `create_topic` and `publish_many` are the Bus's own (cached lookups, the Producer);
    `group_system()` starts the actor system on first use; `system` is it once started.
    """

    def __init__(
        self,
        *,
        dsn: str,
        config: Config,
        pool: asyncpg.Pool,
        lender: db.Lender,
        topic: Callable[[str], Awaitable[TopicInfo]],
        create_topic: TopicCreate,
        publish_many: PublishMany,
        group_system: Callable[[], Awaitable[GroupSystem]],
        resolve: Callable[[str], Awaitable[None]],
    ) -> None:
        self.dsn = dsn
        self.config = config
        self.pool = pool
        self.lender = lender
        self.channels = Channels(config.schema)
        self.topic = topic
        self.create_topic = create_topic
        self.publish_many = publish_many
        # Look a topic and its first partition up now (cached): before a transaction on one of the
        # pool's connections publishes to it, so that the publish needs no second connection.
        self.resolve = resolve
        self.group_system = group_system
        self.system: GroupSystem | None = None
        # The Bus's one time source: its actors' timers wait on it and its lease and expiry statements
        # judge by it (`now`). Unmoved, real time and the server's clock; `bus.testing.Clock` moves it,
        # so a test expires a lease or a session without sleeping past it.
        self.time = BusTime()
        self._states: dict[type[Any], Any] = {}

    def now(self) -> datetime | None:
        """The time lease and expiry statements judge by: None, the server's clock, unless a test moved it.

        Passed as a parameter (`COALESCE($n::timestamptz, clock_timestamp())`), as River's queries take `now`.
        """
        return self.time.now()

    def state(self, kind: type[S], make: Callable[[], S] | None = None) -> S:
        """This Bus's one `kind` (`make()`, else `kind()`, on first use): a sub-facade's per-Bus state."""
        found = self._states.get(kind)
        if found is None:
            found = self._states[kind] = make() if make is not None else kind()
        return found


class Connected(Protocol):
    """Anything that carries a BusContext: a Bus (what public functions like `update_lag(b)` take)."""

    @property
    def context(self) -> BusContext: ...


def context_of(owner: BusContext | Connected) -> BusContext:
    """The context of `owner`: the public classes (QueueConsumer, EventStore, ...) take a Bus or its context."""
    return owner if isinstance(owner, BusContext) else owner.context
