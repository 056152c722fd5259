"""Prometheus metrics of the bus (optional extra: `pip install pgactorbus[metrics]`).

    import bus.metrics

    bus.metrics.start_http_server(9108)               # serves this registry only
    updater = bus.metrics.start_lag_updater(b, 15.0)  # lag gauges refreshed every 15 s
    ...
    await updater.stop()

or, on a service's own endpoint: `body = bus.metrics.generate_latest()`, or
`bus.metrics.register(prometheus_client.REGISTRY)` to add the bus's metrics to
the default registry. The library itself registers nothing there.

Counters and histograms move as the bus works (no database access). Lag is a
gauge set by `await bus.metrics.update_lag(b)` (or the updater actor above),
never computed during a scrape. Metrics, all in `registry`:

| name | labels | what |
| --- | --- | --- |
| `bus_published_messages_total` | topic | messages appended |
| `bus_publish_batch_size` | topic | histogram: messages per publish call |
| `bus_fetch_batch_size` | group, topic | histogram: rows per worker fetch |
| `bus_fetched_messages_total` | group, topic | messages fetched and handed on by workers |
| `bus_consumed_messages_total` | group, topic | messages returned by poll / handled by a subscription |
| `bus_handler_errors_total` | group, topic | handler attempts that raised |
| `bus_dead_lettered_messages_total` | group, topic | messages sent to a dead-letter topic (group "" for queues) |
| `bus_lease_losses_total` | group, topic | leases found lost by workers and claims |
| `bus_rebalances_total` | group | rebalances written here |
| `bus_rebalance_moved_partitions_total` | group | partitions moved by those rebalances |
| `bus_partitions_assigned_total` / `_revoked_total` | group | partitions given to / taken from local members |
| `bus_claims_total` / `bus_claimed_messages_total` / `bus_claim_acks_total` | group, topic | claim mode |
| `bus_queue_taken_messages_total` / `_acked_` / `_nacked_` | topic | queue mode |
| `bus_consumer_lag` / `bus_consumer_lag_seconds` | group, topic, partition | gauges, as describe_group |
| `bus_database_available` | schema | gauge: 1 while the database is reached, 0 during an outage (`b.health()` degraded) |
| `bus_database_outages_total` | schema | database outages ridden out (counted as each ends) |

Without prometheus-client every metric is a no-op, `generate_latest()`
returns b"" and `start_http_server` raises a BusError saying what to install.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from actors.metrics import (
    ASSIGNED,
    CLAIM_ACKS,
    CLAIMED,
    CLAIMS,
    CONSUMED,
    DATABASE_AVAILABLE,
    DATABASE_OUTAGES,
    DEAD_LETTERED,
    ENABLED,
    FETCH_BATCH,
    FETCHED,
    HANDLER_ERRORS,
    LAG,
    LAG_SECONDS,
    LAG_UPDATED,
    LEASE_LOSSES,
    MOVED,
    PUBLISH_BATCH,
    PUBLISHED,
    QUEUE_ACKED,
    QUEUE_NACKED,
    QUEUE_TAKEN,
    REBALANCES,
    REVOKED,
    LagUpdater,
    NoopMetric,
    registry,
)
from actors.metrics import update_lag as _update_lag_pool
from actors.runtime import ActorRef
from storage import db
from storage.errors import BusError, ValidationError
from storage.names import validate_int, validate_name, validate_seconds

if TYPE_CHECKING:
    from bus.context import Connected

__all__ = [
    "ASSIGNED",
    "CLAIMED",
    "CLAIMS",
    "CLAIM_ACKS",
    "CONSUMED",
    "DATABASE_AVAILABLE",
    "DATABASE_OUTAGES",
    "DEAD_LETTERED",
    "ENABLED",
    "FETCHED",
    "FETCH_BATCH",
    "HANDLER_ERRORS",
    "LAG",
    "LAG_SECONDS",
    "LAG_UPDATED",
    "LEASE_LOSSES",
    "MOVED",
    "NoopMetric",
    "PUBLISHED",
    "PUBLISH_BATCH",
    "QUEUE_ACKED",
    "QUEUE_NACKED",
    "QUEUE_TAKEN",
    "REBALANCES",
    "REVOKED",
    "generate_latest",
    "register",
    "registry",
    "start_http_server",
    "start_lag_updater",
    "update_lag",
    "value",
]


def _require() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise BusError(
            "prometheus-client is not installed: install the metrics extra (pip install 'pgactorbus[metrics]')"
        ) from None
    return prometheus_client


def generate_latest() -> bytes:
    """The bus's metrics in the Prometheus text format (b"" without prometheus-client)."""
    if not ENABLED:
        return b""
    return bytes(_require().generate_latest(registry))


def start_http_server(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve the bus's registry on http://addr:port/metrics in a daemon thread; returns (server, thread)."""
    validate_int(port, "port", 0, 65535)
    return _require().start_http_server(port, addr=addr, registry=registry)


class _Forward:
    """A collector that yields the bus registry's metrics (to expose them in another registry)."""

    def collect(self) -> Any:
        return registry.collect()

    def describe(self) -> list[Any]:
        # Nothing to pre-declare: the names are ours alone and checked on collect.
        return []


_forwarded: dict[int, _Forward] = {}


def register(target: Any = None) -> None:
    """Expose the bus's metrics in `target` (default: prometheus' global REGISTRY) as well; idempotent."""
    prom = _require()
    target = prom.REGISTRY if target is None else target
    if id(target) not in _forwarded:
        forward = _Forward()
        target.register(forward)
        _forwarded[id(target)] = forward


def value(name: str, **labels: str) -> float:
    """The current value of one sample of the bus registry (0.0 when absent or without prometheus-client).

    `value("bus_published_messages_total", topic="orders")`.
    """
    if not ENABLED:
        return 0.0
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else float(found)


async def update_lag(
    b: Connected, groups: Iterable[str] | None = None
) -> dict[tuple[str, str, str], tuple[int, float]]:
    """Set the lag gauges of every group of `b`'s schema (or of `groups`) from the database now.

    Returns {(group, topic, partition): (lag, lag_seconds)}; the values equal describe_group's.
    """
    names = None if groups is None else [validate_name(g, "group name") for g in _as_list(groups)]
    with db.translate_errors():
        return await _update_lag_pool(b.context.pool, names, scope=b.context.config.schema)


_updaters = itertools.count()


def start_lag_updater(
    b: Connected, interval: float = 15.0, groups: Sequence[str] | None = None
) -> ActorRef[Any]:
    """Start an actor that calls update_lag every `interval` seconds; `await ref.stop()` before closing `b`."""
    seconds = validate_seconds(interval, "interval")
    names = None if groups is None else [validate_name(g, "group name") for g in _as_list(groups)]
    system = b.context.system
    if system is None:
        raise BusError("the Bus is not connected: start the lag updater after `bus.connect()`")
    return system.root.spawn(
        lambda: LagUpdater(b.context.pool, seconds, names, b.context.config.schema),
        f"lag-updater-{next(_updaters)}",
    )


def _as_list(groups: Iterable[str]) -> list[Any]:
    if isinstance(groups, (str, bytes)):
        raise ValidationError("groups must be a list of group names, not a single string")
    return list(groups)
