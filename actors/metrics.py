"""Prometheus collectors for the bus, and the periodic lag updater.

Every metric lives in ONE dedicated `CollectorRegistry` owned by the bus
(`registry`), never in prometheus' default `REGISTRY`: importing the library
registers nothing global. A service that wants the bus's metrics on its own
endpoint calls `bus.metrics.register(REGISTRY)` or serves `generate_latest()`.

`prometheus-client` is an optional extra (`pip install pgactorbus[metrics]`).
Without it every metric is a no-op object with the same methods, so the
instrumentation calls in the hot paths cost a dict lookup and nothing else.

Hot paths call the small functions at the bottom (`published`, `fetched`,
...). Each caches the labelled child per label tuple, so a call is one dict
lookup plus one `inc`/`observe`; none of them ever touches the database.

Lag (per group and partition) is a gauge that is SET, not computed on scrape:
`update_lag(pool)` reads every group's lag in a few queries and sets the
gauges; `LagUpdater` is an actor that does so every `interval` seconds. A
scrape therefore never runs anything in the database.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg

from actors.runtime import Actor, Message
from storage import groups as group_sql
from storage.logs import get_logger

log = get_logger(__name__)


def _installed() -> bool:
    try:
        return importlib.util.find_spec("prometheus_client") is not None
    except ValueError:  # sys.modules["prometheus_client"] = None: treated as not installed
        return False


#: True when prometheus-client is installed (metrics are real, not no-ops). It is
#: imported, and the metrics created, on first use: `import bus` does not pay for it.
ENABLED = _installed()

# Batch sizes go from single publishes to a full fetch (max_poll_records caps at 100000).
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class NoopMetric:
    """Stands in for a Counter/Gauge/Histogram when prometheus-client is not installed."""

    def labels(self, *values: Any, **labels: Any) -> NoopMetric:
        """Return itself: every child of a no-op metric is the same no-op."""
        return self

    def inc(self, amount: float = 1) -> None:
        """Do nothing."""

    def dec(self, amount: float = 1) -> None:
        """Do nothing."""

    def set(self, value: float) -> None:
        """Do nothing."""

    def observe(self, value: float) -> None:
        """Do nothing."""

    def remove(self, *values: Any) -> None:
        """Do nothing."""

    def clear(self) -> None:
        """Do nothing."""


class _LazyMetric:
    """A prometheus metric created (with every other one, in the bus's registry) on first use."""

    __slots__ = ("kind", "name", "doc", "label_names", "real")

    def __init__(self, kind: str, name: str, doc: str, label_names: Sequence[str]) -> None:
        self.kind, self.name, self.doc, self.label_names = kind, name, doc, list(label_names)
        self.real: Any = None
        _declared.append(self)

    def __getattr__(self, attribute: str) -> Any:
        _materialize()
        return getattr(self.real, attribute)


_declared: list[_LazyMetric] = []
_registry: Any = None
# Held while the metrics are made: by the warm-up thread (`prepare`) or by a first use racing it.
_making = threading.Lock()


def prepare() -> None:
    """Make the metrics now, in a background thread, if nothing has yet.

    Importing prometheus-client and creating the metrics takes tenths of a second of
    CPU. Paid on first use, it would stall the event loop at a bad moment: a process's first
    partition assignment (its new workers wait behind it, and a join takes that much
    longer). A Bus calls this when it starts; `import bus` still does not pay.
    """
    if ENABLED and _registry is None and not _making.locked():
        threading.Thread(target=_materialize, name="bus-metrics", daemon=True).start()


def _materialize() -> Any:
    """Import prometheus-client, create the bus's own registry and every declared metric in it."""
    if _registry is None:
        with _making:
            _make()
    return _registry


def _make() -> None:
    global _registry
    if _registry is None:
        import prometheus_client as prom

        # auto_describe lets get_sample_value and the text exposition see label names up front.
        registry = prom.CollectorRegistry(auto_describe=True)
        for m in _declared:
            if m.kind == "counter":
                m.real = prom.Counter(m.name, m.doc, m.label_names, registry=registry)
            elif m.kind == "gauge":
                m.real = prom.Gauge(m.name, m.doc, m.label_names, registry=registry)
            else:
                m.real = prom.Histogram(
                    m.name, m.doc, m.label_names, buckets=BATCH_BUCKETS, registry=registry
                )
        _registry = registry


def __getattr__(name: str) -> Any:
    # `registry`: the bus's own registry (None without prometheus-client), made on first access.
    if name == "registry":
        return _materialize() if ENABLED else None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _counter(name: str, doc: str, labels: Sequence[str]) -> Any:
    return _LazyMetric("counter", name, doc, labels) if ENABLED else NoopMetric()


def _gauge(name: str, doc: str, labels: Sequence[str]) -> Any:
    return _LazyMetric("gauge", name, doc, labels) if ENABLED else NoopMetric()


def _histogram(name: str, doc: str, labels: Sequence[str]) -> Any:
    return _LazyMetric("histogram", name, doc, labels) if ENABLED else NoopMetric()


# -- the metrics (names without the `_total` suffix prometheus adds to counters) ----------

PUBLISHED = _counter("bus_published_messages", "Messages appended to the log, per topic.", ["topic"])
PUBLISH_BATCH = _histogram(
    "bus_publish_batch_size", "Messages per publish/publish_many call, per topic.", ["topic"]
)
FETCH_BATCH = _histogram(
    "bus_fetch_batch_size",
    "Rows per non-empty fetch of a partition worker, per group and topic.",
    ["group", "topic"],
)
FETCHED = _counter(
    "bus_fetched_messages",
    "Messages fetched by partition workers and handed on, per group and topic.",
    ["group", "topic"],
)
CONSUMED = _counter(
    "bus_consumed_messages",
    "Messages given to the application (returned by poll, or handled without error), per group and topic.",
    ["group", "topic"],
)
HANDLER_ERRORS = _counter(
    "bus_handler_errors",
    "Handler calls that raised (each failed attempt), per group and topic.",
    ["group", "topic"],
)
DEAD_LETTERED = _counter(
    "bus_dead_lettered_messages",
    "Messages moved to a dead-letter topic, per group (empty for queue topics) and source topic.",
    ["group", "topic"],
)
LEASE_LOSSES = _counter(
    "bus_lease_losses",
    "Partition or claim leases found lost (expired and taken, or fenced), per group and topic.",
    ["group", "topic"],
)
REBALANCES = _counter(
    "bus_rebalances", "Rebalances written by this process's Rebalancers, per group.", ["group"]
)
MOVED = _counter(
    "bus_rebalance_moved_partitions", "Partitions given to a new owner by rebalances, per group.", ["group"]
)
ASSIGNED = _counter("bus_partitions_assigned", "Partitions assigned to local members, per group.", ["group"])
REVOKED = _counter("bus_partitions_revoked", "Partitions revoked from local members, per group.", ["group"])
CLAIMS = _counter(
    "bus_claims", "Claims granted (partitions leased by claim()), per group and topic.", ["group", "topic"]
)
CLAIMED = _counter(
    "bus_claimed_messages", "Messages returned by claims, per group and topic.", ["group", "topic"]
)
CLAIM_ACKS = _counter("bus_claim_acks", "Claims acked, per group and topic.", ["group", "topic"])
QUEUE_TAKEN = _counter("bus_queue_taken_messages", "Jobs taken by queue consumers, per topic.", ["topic"])
QUEUE_ACKED = _counter("bus_queue_acked_messages", "Jobs acked by queue consumers, per topic.", ["topic"])
QUEUE_NACKED = _counter("bus_queue_nacked_messages", "Jobs nacked by queue consumers, per topic.", ["topic"])
LAG = _gauge(
    "bus_consumer_lag",
    "Messages not yet committed (end offset - committed), per group and partition.",
    ["group", "topic", "partition"],
)
LAG_SECONDS = _gauge(
    "bus_consumer_lag_seconds",
    "Age of the oldest uncommitted message (0 when caught up), per group and partition.",
    ["group", "topic", "partition"],
)
LAG_UPDATED = _gauge(
    "bus_lag_last_update_timestamp_seconds", "When update_lag last set the lag gauges (unix time).", []
)
DATABASE_AVAILABLE = _gauge(
    "bus_database_available",
    "1 while this process's Buses reach their database, 0 during an outage (Bus.health() degraded), per schema.",
    ["schema"],
)
DATABASE_OUTAGES = _counter(
    "bus_database_outages",
    "Database outages this process's Buses rode out (counted when each ends), per schema.",
    ["schema"],
)


def database_available(schema: str, available: bool, ended_outage: bool = False) -> None:
    """A Bus on `schema` reaches its database again (`ended_outage`: after an outage), or no longer does."""
    child(DATABASE_AVAILABLE, schema).set(1 if available else 0)
    if ended_outage:
        child(DATABASE_OUTAGES, schema).inc()


# -- cheap hot-path helpers: one dict lookup for a cached child, then inc/observe ----------

_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """The labelled child of `metric`, cached so that hot paths do not rebuild it."""
    key = (id(metric), labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


_published: dict[str, tuple[Any, Any]] = {}


def published(topic: str, count: int) -> None:
    """A publish call appended `count` messages to `topic`."""
    pair = _published.get(topic)
    if pair is None:
        pair = _published[topic] = (child(PUBLISHED, topic), child(PUBLISH_BATCH, topic))
    pair[0].inc(count)
    pair[1].observe(count)


def fetched(group: str, topic: str, count: int) -> None:
    """A partition worker fetched a non-empty batch and hands it on."""
    child(FETCHED, group, topic).inc(count)
    child(FETCH_BATCH, group, topic).observe(count)


def consumed(group: str, topic: str, count: int = 1) -> None:
    """The application received `count` messages (poll) or handled one (subscription)."""
    child(CONSUMED, group, topic).inc(count)


def handler_error(group: str, topic: str) -> None:
    """A handler attempt raised."""
    child(HANDLER_ERRORS, group, topic).inc()


def dead_lettered(group: str, topic: str, count: int = 1) -> None:
    """Messages of `topic` went to a dead-letter topic (group "" for queue topics)."""
    child(DEAD_LETTERED, group, topic).inc(count)


def lease_lost(group: str, topic: str) -> None:
    """A partition worker or a claim found its lease gone."""
    child(LEASE_LOSSES, group, topic).inc()


def rebalanced(group: str, moved: int) -> None:
    """A Rebalancer wrote a new generation that moved `moved` partitions."""
    child(REBALANCES, group).inc()
    if moved:
        child(MOVED, group).inc(moved)


def assigned(group: str, count: int) -> None:
    """A local member was given `count` partitions."""
    if count:
        child(ASSIGNED, group).inc(count)


def revoked(group: str, count: int) -> None:
    """A local member gave up `count` partitions."""
    if count:
        child(REVOKED, group).inc(count)


def claimed(group: str, topic: str, count: int) -> None:
    """A claim leased a partition of `topic` with `count` messages."""
    child(CLAIMS, group, topic).inc()
    child(CLAIMED, group, topic).inc(count)


def claim_acked(group: str, topic: str) -> None:
    """A claim was acked."""
    child(CLAIM_ACKS, group, topic).inc()


def queue_taken(topic: str, count: int) -> None:
    """A queue consumer took `count` jobs."""
    if count:
        child(QUEUE_TAKEN, topic).inc(count)


def queue_acked(topic: str, count: int = 1) -> None:
    """A queue consumer acked `count` jobs."""
    if count:
        child(QUEUE_ACKED, topic).inc(count)


def queue_nacked(topic: str) -> None:
    """A queue consumer nacked a job."""
    child(QUEUE_NACKED, topic).inc()


# -- lag ---------------------------------------------------------------------------------

# Per scope (the bus schema): the (group, topic, partition) label sets the last
# update set, so that partitions and groups that disappeared leave the gauges.
_lag_labels: dict[str, set[tuple[str, str, str]]] = {}


async def read_lag(
    pool: asyncpg.Pool, groups: Iterable[str] | None = None
) -> dict[tuple[str, str, str], tuple[int, float]]:
    """Lag and lag seconds of every partition of every group (or of `groups`), like describe_group.

    Partitions without a cursor are measured from the group's recorded start
    (read-only, like describe_group), so a `latest` group's lag never counts
    what its start skipped.
    """
    if groups is None:
        names = [r.name for r in await group_sql.list_groups(pool)]
    else:
        names = list(groups)
    out: dict[tuple[str, str, str], tuple[int, float]] = {}
    for name in names:
        for r in await group_sql.describe_partitions(pool, name):
            lag = int(r.lag)
            seconds = 0.0 if lag == 0 or r.lag_seconds is None else float(r.lag_seconds)
            out[(name, r.topic, r.partition)] = (lag, seconds)
    return out


async def update_lag(
    pool: asyncpg.Pool, groups: Iterable[str] | None = None, *, scope: str = ""
) -> dict[tuple[str, str, str], tuple[int, float]]:
    """Set the lag gauges from the database now; returns what it set.

    Label sets an earlier update of the same `scope` (the schema) set and that no longer exist (deleted
    groups, topics) are removed. With `groups`, only those groups are
    refreshed and nothing else is removed.
    """
    import time

    values = await read_lag(pool, groups)
    for (group, topic, partition), (lag, seconds) in values.items():
        child(LAG, group, topic, partition).set(lag)
        child(LAG_SECONDS, group, topic, partition).set(seconds)
    previous = _lag_labels.get(scope, set())
    if groups is None:
        for labels in previous - set(values):
            _forget(LAG, labels)
            _forget(LAG_SECONDS, labels)
        _lag_labels[scope] = set(values)
    else:
        _lag_labels[scope] = previous | set(values)
    LAG_UPDATED.set(time.time())
    return values


def _forget(metric: Any, labels: tuple[str, ...]) -> None:
    _children.pop((id(metric), labels), None)
    try:
        metric.remove(*labels)
    except KeyError:  # already gone (another scope with the same labels removed it)
        pass


class UpdateLag(Message, frozen=True):
    """Tick of the LagUpdater: refresh the lag gauges."""


class LagUpdater(Actor[UpdateLag]):
    """Refreshes the lag gauges every `interval` seconds (a few queries per group).

    A failed refresh (database briefly away) is logged and retried at the next tick.
    """

    mailbox_size = 2

    def __init__(
        self, pool: asyncpg.Pool, interval: float, groups: Sequence[str] | None = None, scope: str = ""
    ) -> None:
        self._pool = pool
        self._scope = scope
        self._interval = interval
        self._groups = list(groups) if groups is not None else None
        self._log = get_logger(__name__, actor="lag_updater")

    async def on_start(self) -> None:
        self.self_ref.schedule_every(self._interval, UpdateLag())
        self.self_ref.signal(UpdateLag())

    async def receive(self, message: UpdateLag) -> None:
        try:
            await update_lag(self._pool, self._groups, scope=self._scope)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError) as exc:
            self._log.warning("lag_update_failed", error=str(exc))
