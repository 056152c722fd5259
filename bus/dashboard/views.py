"""What each dashboard page shows, gathered through the public API and `storage.dashboard`.

Every function here returns plain dicts and lists for the templates, so the
same data serves the full page and its live (SSE) fragment.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

import msgspec
from markupsafe import Markup, escape

from storage import dashboard as sql
from storage import db
from storage.compaction import sql as compaction_sql
from storage.errors import TopicNotFoundError, ValidationError
from storage.logs import get_logger
from storage.names import validate_name

if TYPE_CHECKING:
    from bus.client import Bus

log = get_logger(__name__)

#: Dead letters listed per page, and payload bytes shown of each.
DEAD_LETTER_LIMIT = 200
PAYLOAD_PREVIEW = 400
#: At most this many dead letters are replayed by one "replay all".
REPLAY_LIMIT = 1000
# Headers the dead-lettering added; a replayed message goes back without them.
_DEAD_LETTER_PREFIXES = ("dead_letter.",)


#: Seconds between two writes of the groups' lags to `lag_samples` (its bucket width).
LAG_KEPT_EVERY = 10.0


class History:
    """Samples of every group's total lag and every topic's end offset over the last minutes.

    One sample costs two queries (list_groups and the partition bounds), taken
    every `interval` seconds by a task started with the first page view. Every
    10 seconds the groups' lags are also kept in the database (`lag_samples`, the
    last hour), so a chart opened by a dashboard started later shows the hour
    before it too (`lag_points`).
    """

    def __init__(self, seconds: float = 600.0, interval: float = 1.0) -> None:
        self.interval = max(interval, 0.05)
        self.maxlen = max(int(seconds / self.interval) + 1, 2)
        self.lag: dict[str, deque[tuple[float, int]]] = {}
        self.ends: dict[str, deque[tuple[float, int]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._kept_at = 0.0  # when the lags were last written to the database

    def ensure_running(self, b: Bus) -> None:
        """Start the sampling task unless it runs (a mounted app gets no lifespan events)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(b), name="dashboard-history")

    async def stop(self) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the sampler's own failures were logged
                pass
            self._task = None

    async def _run(self, b: Bus) -> None:
        while True:
            try:
                await self.sample(b)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a page must not die because one sample failed
                log.warning("dashboard_sample_failed", error=repr(exc))
            await asyncio.sleep(self.interval)

    async def sample(self, b: Bus) -> None:
        """Record one sample now."""
        now = time.time()
        groups = await b.admin.list_groups()
        with db.translate_errors():
            parts = await sql.topic_partitions(b.pool)
        for g in groups:
            self.lag.setdefault(g.name, deque(maxlen=self.maxlen)).append((now, g.total_lag))
        if groups and now - self._kept_at >= LAG_KEPT_EVERY:
            self._kept_at = now
            with db.translate_errors():
                await sql.record_lag(b.pool, {g.name: g.total_lag for g in groups})
        ends: dict[str, int] = {}
        for p in parts:
            ends[p.topic] = ends.get(p.topic, 0) + p.end_offset
        for topic, end in ends.items():
            self.ends.setdefault(topic, deque(maxlen=self.maxlen)).append((now, end))

    async def lag_points(self, b: Bus, group: str) -> list[tuple[float, int]]:
        """The group's lag over the last hour: the database's samples, then this process's own."""
        mine = list(self.lag.get(group, ()))
        with db.translate_errors():
            kept = await sql.lag_history(b.pool, group)
        first = mine[0][0] if mine else float("inf")
        return [p for p in kept if p[0] < first] + mine

    def rate(self, topic: str, window: float = 10.0) -> float | None:
        """Messages per second published to `topic` over about the last `window` seconds."""
        samples = self.ends.get(topic)
        if not samples or len(samples) < 2:
            return None
        last_t, last_end = samples[-1]
        first_t, first_end = samples[0]
        for t, end in reversed(samples):
            first_t, first_end = t, end
            if last_t - t >= window:
                break
        if last_t <= first_t:
            return None
        return max(last_end - first_end, 0) / (last_t - first_t)


def lag_chart(points: Sequence[tuple[float, int]], *, width: int = 640, height: int = 160) -> Markup:
    """An inline SVG line chart of (unix time, lag) points; axis labels give the scale."""
    if not points:
        return Markup('<svg class="chart" role="img" aria-label="no lag samples yet"></svg>')
    pad_l, pad_r, pad_t, pad_b = 52, 8, 8, 22
    t0, t1 = points[0][0], points[-1][0]
    span = max(t1 - t0, 1.0)
    top = max(max(v for _, v in points), 1)
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def xy(t: float, v: int) -> str:
        return f"{pad_l + (t - t0) / span * w:.1f},{pad_t + h - v / top * h:.1f}"

    line = " ".join(xy(t, v) for t, v in points)
    last = points[-1][1]
    label = escape(f"lag over the last {span:.0f} s, now {last}")
    return Markup(
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{label}" data-points="{len(points)}">'
        f'<line class="axis" x1="{pad_l}" y1="{pad_t + h}" x2="{width - pad_r}" y2="{pad_t + h}"/>'
        f'<line class="axis" x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + h}"/>'
        f'<text x="{pad_l - 4}" y="{pad_t + 10}" text-anchor="end">{top}</text>'
        f'<text x="{pad_l - 4}" y="{pad_t + h}" text-anchor="end">0</text>'
        f'<text x="{pad_l}" y="{height - 4}">-{span:.0f} s</text>'
        f'<text x="{width - pad_r}" y="{height - 4}" text-anchor="end">now</text>'
        f'<polyline class="line" points="{line}"/></svg>'
    )


def _seconds(value: timedelta | None) -> str:
    if value is None:
        return "forever"
    s = value.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size and s % size == 0:
            return f"{int(s // size)} {unit}"
    return f"{s:g} s"


async def topics_page(b: Bus, history: History) -> dict[str, Any]:
    """Every topic: partitions, size, end offset, log start, publish rate, retention."""
    topics = await b.list_topics()
    with db.translate_errors():
        parts = await sql.topic_partitions(b.pool)
    by_topic: dict[str, list[sql.PartitionBounds]] = {}
    for p in parts:
        by_topic.setdefault(p.topic, []).append(p)
    rows = []
    for t in topics:
        ps = by_topic.get(t.name, [])
        rate = history.rate(t.name)
        rows.append(
            {
                "name": t.name,
                "partitions": "dynamic" if t.partitions is None else t.partitions,
                "partition_count": len(ps),
                "semantics": t.semantics,
                "cleanup": t.cleanup,
                "retention": _seconds(t.retention),
                "namespace": t.namespace or "",
                "task": t.task or "",
                "size": sum(p.end_offset - p.log_start for p in ps),
                "end_offset": sum(p.end_offset for p in ps),
                "log_start": min((p.log_start for p in ps), default=0),
                "rate": "-" if rate is None else f"{rate:.1f}",
            }
        )
    return {"topics": rows}


async def topic_page(b: Bus, name: str, history: History) -> dict[str, Any]:
    """One topic: its configuration and every partition's bounds, exact size and ages."""
    validate_name(name, "topic name")
    info = await b.topic(name)
    stats = await b.admin.topic_stats(name)
    rate = history.rate(name)
    return {
        "topic": {
            "name": info.name,
            "partitions": "dynamic" if info.partitions is None else info.partitions,
            "semantics": info.semantics,
            "cleanup": info.cleanup,
            "retention": _seconds(info.retention),
            "tombstone_retention": _seconds(info.tombstone_retention),
            "namespace": info.namespace or "",
            "task": info.task or "",
            "max_message_bytes": info.max_message_bytes,
            "created_at": info.created_at,
            "rate": "-" if rate is None else f"{rate:.1f}",
        },
        "stats": stats,
        "size": sum(s.size for s in stats),
    }


async def groups_page(b: Bus, history: History) -> dict[str, Any]:
    """Every consumer group with state, generation, members, total lag and a small lag chart."""
    groups = await b.admin.list_groups()
    return {
        "groups": [
            {"g": g, "chart": lag_chart(list(history.lag.get(g.name, ())), width=220, height=48)}
            for g in groups
        ]
    }


async def group_page(b: Bus, name: str, history: History) -> dict[str, Any]:
    """`describe_group` plus the lag chart of the last hour (kept in the database)."""
    d = await b.admin.describe_group(name)
    points = await history.lag_points(b, name)
    # The table is read now; make the chart end at the same value.
    points.append((time.time(), d.total_lag))
    return {"d": d, "chart": lag_chart(points), "live_members": sum(1 for m in d.members if m.live)}


def _headers(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    value = msgspec.json.decode(text)
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _errors(headers: dict[str, str]) -> list[dict[str, Any]]:
    raw = headers.get("dead_letter.errors")
    if not raw:
        return []
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return [{"error": raw}]
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []


def _preview(payload: bytes | None, total: int | None) -> str:
    if payload is None:
        return "(tombstone)"
    text = payload.decode("utf-8", errors="replace")
    return text + (f"… ({total} bytes)" if total is not None and total > len(payload) else "")


async def queues_page(b: Bus) -> dict[str, Any]:
    """Every queue topic: ready, in flight, delayed, and dead (its jobs waiting in its dead-letter topic)."""
    with db.translate_errors():
        rows = await sql.queue_counts(b.pool)
    counts = {r.topic: r for r in rows}
    queues = []
    for r in rows:
        dlq = f"{r.topic}.dlq"
        # The same count as the queue's own page and `admin.queue_depth`: its dead letters still waiting.
        dead = (await b.admin.queue_depth(r.topic)).dead if dlq in counts else None
        queues.append(
            {
                "topic": r.topic,
                "ready": r.ready,
                "in_flight": r.in_flight,
                "delayed": r.delayed,
                "next_delayed": r.next_delayed,
                "dead_letter": dlq if dead is not None else None,
                "dead": dead,
                "is_dead_letter": r.topic.endswith(".dlq") and r.topic[: -len(".dlq")] in counts,
            }
        )
    return {"queues": queues}


async def queue_page(b: Bus, name: str) -> dict[str, Any]:
    """One queue topic: its counts and dead letters (those it holds as a dead-letter topic, else its own
    waiting in its dead-letter topic, the count the queue list shows)."""
    validate_name(name, "topic name")
    info = await b.topic(name)
    if info.semantics != "queue":
        raise ValidationError(f"topic {name!r} is not a queue topic (semantics={info.semantics!r})")
    with db.translate_errors():
        counts = {r.topic: r for r in await sql.queue_counts(b.pool)}
    dlq = f"{name}.dlq"
    dead: int | None = None
    held = name
    if dlq in counts:
        dead = (await b.admin.queue_depth(name)).dead
        held = dlq
    with db.translate_errors():
        letters = await sql.dead_letters(b.pool, held, DEAD_LETTER_LIMIT, PAYLOAD_PREVIEW)
    if held != name:
        letters = [m for m in letters if _headers(m.headers).get("dead_letter.topic") == name]
    messages = []
    for m in letters:
        headers = _headers(m.headers)
        messages.append(
            {
                "partition": m.partition,
                "offset": m.offset,
                "key": m.key,
                "created_at": m.created_at,
                "leased": m.leased,
                "source": headers.get("dead_letter.topic"),
                "source_at": f"{headers.get('dead_letter.partition', '?')}@{headers.get('dead_letter.offset', '?')}",
                "attempts": headers.get("dead_letter.attempts", ""),
                "last_error": headers.get("dead_letter.last_error", ""),
                "errors": _errors(headers),
                "payload": _preview(m.payload, m.payload_bytes),
            }
        )
    return {
        "name": name,
        "counts": counts.get(name),
        "dead_letter": dlq if dlq in counts else None,
        "dead": dead,
        "held": held,
        "messages": messages,
        "replayable": sum(1 for m in messages if m["source"]),
        "limit": DEAD_LETTER_LIMIT,
    }


async def replay(
    b: Bus, dead_letter_topic: str, partition: str | None = None, offset: int | None = None
) -> int:
    """Move dead letters back into the queue they came from; returns how many.

    One transaction: the dead-letter jobs are deleted and their messages
    published again to the topic named by their `dead_letter.topic` header
    (same key, payload and original headers, plus `replayed_from`), so a
    failure part-way replays nothing. Jobs a consumer holds right now are left.
    """
    validate_name(dead_letter_topic, "topic name")
    if (partition is None) != (offset is None):
        raise ValidationError("replay one message with both partition and offset, or all with neither")
    info = await b.topic(dead_letter_topic)
    if info.semantics != "queue":
        raise ValidationError(
            f"{dead_letter_topic!r} is not a queue topic; only queue dead letters can be replayed"
        )
    from bus.types import Outgoing

    with db.translate_errors():
        async with b.pool.acquire() as conn, conn.transaction():
            rows = await sql.take_dead_letters(conn, dead_letter_topic, partition, offset, REPLAY_LIMIT)
            by_topic: dict[str, list[Outgoing]] = {}
            for r in rows:
                headers = _headers(r.headers)
                source = headers.get("dead_letter.topic")
                if not source:
                    raise ValidationError(
                        f"{dead_letter_topic}/{r.partition}@{r.offset} has no dead_letter.topic header: "
                        "it was not dead-lettered by a queue consumer, so there is nowhere to replay it"
                    )
                kept = {k: v for k, v in headers.items() if not k.startswith(_DEAD_LETTER_PREFIXES)}
                kept["replayed_from"] = f"{dead_letter_topic}/{r.partition}@{r.offset}"
                payload = r.payload if r.payload is not None else b""
                by_topic.setdefault(source, []).append(Outgoing(payload, key=r.key, headers=kept))
            for topic, outgoing in by_topic.items():
                try:
                    await b.topic(topic)
                except TopicNotFoundError:
                    raise TopicNotFoundError(
                        f"the dead letters' original topic {topic!r} no longer exists; create it to replay them"
                    ) from None
                # The pool's connection proxy is a connection (asyncpg's own annotation says otherwise).
                await b.publish_many(topic, outgoing, connection=cast(Any, conn))
    if partition is not None and not rows:
        raise ValidationError(
            f"{dead_letter_topic}/{partition}@{offset} is not waiting there (already replayed, consumed, "
            "or held by a consumer right now)"
        )
    log.info("dead_letters_replayed", topic=dead_letter_topic, count=len(rows))
    return len(rows)


async def claims_page(b: Bus) -> dict[str, Any]:
    """Claims groups (leases, pending partitions, lag) and event-store groups (status, errors, retries)."""
    with db.translate_errors():
        groups = await sql.claim_groups(b.pool)
        es = await sql.es_groups(b.pool)
    es_rows = []
    for g in es:
        error = None if g["error_context"] is None else msgspec.json.decode(g["error_context"])
        es_rows.append({**dict(g), "error": error})
    return {"claim_groups": [dict(g) for g in groups], "es_groups": es_rows}


async def claim_group_page(b: Bus, name: str) -> dict[str, Any]:
    """One claims group's cursors with their live leases."""
    validate_name(name, "group name")
    with db.translate_errors():
        groups = {g["name"]: g for g in await sql.claim_groups(b.pool)}
        if name not in groups:
            from storage.errors import GroupNotFoundError

            raise GroupNotFoundError(
                f"no claims group {name!r} (groups with live members are on the Groups page)"
            )
        leases = await sql.claim_leases(b.pool, name)
    return {"group": dict(groups[name]), "leases": [dict(r) for r in leases]}


async def es_group_page(b: Bus, store: str, group: str) -> dict[str, Any]:
    """One event-store group: status, error context, and its partitions that are claimed, failing or waiting."""
    validate_name(store, "event store name")
    validate_name(group, "group name")
    with db.translate_errors():
        rows = [g for g in await sql.es_groups(b.pool) if g["store"] == store and g["name"] == group]
        if not rows:
            from storage.errors import GroupNotFoundError

            raise GroupNotFoundError(f"event store {store!r} has no group {group!r}")
        troubled = await sql.es_troubled_partitions(b.pool, store, group, 200)
    g = rows[0]
    error = None if g["error_context"] is None else msgspec.json.decode(g["error_context"])
    return {"g": {**dict(g), "error": error}, "partitions": [dict(r) for r in troubled]}


async def set_claim_group_status(b: Bus, group: str, status: str) -> None:
    """Stop (claims return None) or start a claims group."""
    validate_name(group, "group name")
    with db.translate_errors():
        ok = await sql.set_group_status(b.pool, group, status)
    if not ok:
        from storage.errors import GroupNotFoundError

        raise GroupNotFoundError(f"group {group!r} does not exist or is dead/cancelled")


async def compaction_page(b: Bus) -> dict[str, Any]:
    """The recorded compaction runs, newest first (`bus compact --status`)."""
    with db.translate_errors():
        runs = await b.pool.fetch(compaction_sql.SELECT_RUNS, 50)
    return {"runs": [dict(r) for r in runs]}


def ago(value: datetime | None) -> str:
    """'12 s ago' / 'in 3 s' for a timestamp; '-' for None."""
    if value is None:
        return "-"
    delta = (datetime.now(value.tzinfo) - value).total_seconds()
    if delta >= 0:
        return f"{delta:.0f} s ago" if delta < 120 else f"{delta / 60:.0f} min ago"
    return f"in {-delta:.0f} s" if -delta < 120 else f"in {-delta / 60:.0f} min"
