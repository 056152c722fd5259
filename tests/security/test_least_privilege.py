"""The bus runs as an ordinary PostgreSQL role that owns only its own schema.

As the test server's superuser we create a role with LOGIN and nothing else
(NOSUPERUSER NOCREATEDB NOCREATEROLE), grant it CREATE on the database so it
can create its schema, and run every delivery mode through a Bus connected as
that role. Then the catalogs must show that everything the role owns lives in
its schema, that nothing else was created or changed, and that no superuser
right was needed on the way.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import bus
import bus.metrics
import bus.testing

FAST: dict[str, Any] = {
    **bus.testing.FAST,
    "cleaner_interval": 0.2,
}  # the retention cleaner runs as the role too

PASSWORD = "bus-app-secret"


class SecurityEvent(bus.Event, tag="security.course.created"):
    course_name: str


@dataclass
class AppRole:
    """A fresh unprivileged role, the DSN that logs in as it, and a bystander schema it must not touch."""

    name: str
    dsn: str
    schema: str
    bystander: str


def _as_role(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{role}:{PASSWORD}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


# Catalog queries of the test (the role's oid is a parameter; names come from uuid hex).
OWNED_OUTSIDE_SCHEMA = """
SELECT 'relation ' || c.relname FROM pg_class c
 WHERE c.relowner = $1::regrole AND c.relnamespace <> $2::regnamespace
   -- PostgreSQL keeps every table's TOAST table (and its index) in pg_toast: allowed
   -- when the table it belongs to is in the bus schema.
   AND NOT EXISTS (SELECT 1 FROM pg_class t
                    WHERE t.relnamespace = $2::regnamespace
                      AND (t.reltoastrelid = c.oid
                           OR t.reltoastrelid = (SELECT i.indrelid FROM pg_index i WHERE i.indexrelid = c.oid)))
UNION ALL
SELECT 'function ' || p.proname FROM pg_proc p
 WHERE p.proowner = $1::regrole AND p.pronamespace <> $2::regnamespace
UNION ALL
SELECT 'type ' || t.typname FROM pg_type t
 WHERE t.typowner = $1::regrole AND t.typnamespace <> $2::regnamespace
UNION ALL
SELECT 'schema ' || n.nspname FROM pg_namespace n
 WHERE n.nspowner = $1::regrole AND n.oid <> $2::regnamespace
UNION ALL
SELECT 'extension ' || e.extname FROM pg_extension e WHERE e.extowner = $1::regrole
UNION ALL
SELECT 'large object ' || l.oid::text FROM pg_largeobject_metadata l WHERE l.lomowner = $1::regrole
"""

IN_SCHEMA_NOT_OWNED = """
SELECT 'relation ' || c.relname FROM pg_class c
 WHERE c.relnamespace = $2::regnamespace AND c.relowner <> $1::regrole
UNION ALL
SELECT 'function ' || p.proname FROM pg_proc p
 WHERE p.pronamespace = $2::regnamespace AND p.proowner <> $1::regrole
"""

SNAPSHOT_OTHER_SCHEMAS = """
SELECT n.nspname, c.relname, c.relkind, c.relowner::regrole::text AS owner
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = ANY($1::text[])
ORDER BY 1, 2
"""


@pytest.fixture
async def app_role(dsn: str) -> AsyncIterator[AppRole]:
    admin = await asyncpg.connect(dsn)
    try:
        if not await admin.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
            pytest.skip("the test database user is not a superuser: cannot create a role to test with")
        tag = uuid.uuid4().hex[:10]
        role = AppRole(f"bus_app_{tag}", "", f"bus_sec_{tag}", f"other_{tag}")
        role.dsn = _as_role(dsn, role.name)
        db_name = await admin.fetchval("SELECT current_database()")
        # DDL takes no parameters: the names are ours (uuid hex), the password a constant.
        await admin.execute(
            f"CREATE ROLE {role.name} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT PASSWORD '{PASSWORD}'"
        )
        await admin.execute(f'GRANT CREATE ON DATABASE "{db_name}" TO {role.name}')
        # Another application's schema, with data, that the bus must not touch.
        await admin.execute(f"CREATE SCHEMA {role.bystander}")
        await admin.execute(f"CREATE TABLE {role.bystander}.accounts (id int PRIMARY KEY, balance int)")
        await admin.execute(f"INSERT INTO {role.bystander}.accounts VALUES (1, 100), (2, 250)")
        yield role
    finally:
        if "role" in locals():
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role.name
            )
            await admin.execute(f"DROP SCHEMA IF EXISTS {role.schema} CASCADE")
            await admin.execute(f"DROP SCHEMA IF EXISTS {role.bystander} CASCADE")
            await admin.execute(f"DROP OWNED BY {role.name} CASCADE")  # also revokes CREATE on the database
            await admin.execute(f"DROP ROLE IF EXISTS {role.name}")
        await admin.close()


async def _exercise_every_mode(b: bus.Bus) -> None:
    """Topics, publishing, reading, a consumer group, a subscription, claims, a queue and an event store."""
    await b.create_topic("orders", partitions=2, retention=3600)
    await b.create_topic("devices", partitions=None, namespace="iot")
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.create_topic("latest", partitions=1, cleanup="compact")
    await b.publish("orders", {"id": 1}, key="c-1", headers={"h": "v"})
    await b.publish_many("orders", [bus.Outgoing({"id": i}, key=f"c-{i}") for i in range(2, 6)])
    await b.publish("devices", b"r", partition="dev-1")
    await b.publish("latest", None, key="gone")  # a tombstone
    async with b.pool.acquire() as conn, conn.transaction():  # the outbox
        await b.publish("orders", {"id": 6}, connection=conn)
    assert len(await b.read("orders", partition="0")) + len(await b.read("orders", partition="1")) == 6

    async with b.consumer("email", topics=["orders"]) as c:
        got: list[bus.Message] = []
        while len(got) < 6:
            got.extend(await c.poll(timeout=5.0))
        await c.commit()

    seen: list[int] = []

    async def handler(m: bus.Message) -> None:
        seen.append(m.offset)

    sub = await b.subscribe("audit", handler, topics=["orders"], dead_letter="orders.dlq")
    await sub.stop()

    claim = await b.claim("ingest", namespace="iot", worker_id="w-1")
    assert claim is not None
    await claim.ack()

    await b.publish_many("jobs", [b"a", b"b"])
    async with b.queue_consumer("jobs", max_attempts=1) as q:
        jobs = await q.take(max_messages=2, timeout=2.0)
        await q.ack(jobs[0])
        await q.nack(jobs[1], error="to the dead-letter topic")

    store = b.event_store("courses")
    await store.register_group("enrollment")
    await store.append([SecurityEvent(course_name="Algebra")])
    ec = await store.claim_next(
        "enrollment", partition_by=["course_name"], handled_types=[SecurityEvent], worker_id="w-1"
    )
    assert ec is not None
    await store.append([SecurityEvent(course_name="Algebra")], guard=None)
    await store.ack("enrollment", offset_id=ec.offset_id, position=ec.messages[-1].position)

    await b.admin.describe_group("email")
    await b.admin.list_groups()
    await b.admin.sweep()
    await b.admin.topic_stats("orders")
    await b.admin.force_complete("orders", older_than=3600)
    await bus.metrics.update_lag(b)
    await b.delete_topic("latest")


async def test_the_bus_runs_as_an_unprivileged_role_that_owns_only_its_schema(
    app_role: AppRole, dsn: str
) -> None:
    admin = await asyncpg.connect(dsn)
    try:
        others = ["public", app_role.bystander]
        before = [tuple(r) for r in await admin.fetch(SNAPSHOT_OTHER_SCHEMAS, others)]

        b = await bus.connect(app_role.dsn, schema=app_role.schema, **FAST)
        try:
            assert await b.pool.fetchval("SELECT current_user") == app_role.name
            assert not await b.pool.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            # A second process of the same application on the same schema (migrations are idempotent).
            b2 = await bus.connect(app_role.dsn, schema=app_role.schema, **FAST)
            await b2.close()
            await _exercise_every_mode(b)
        finally:
            await b.close()

        owner = await admin.fetchval(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = $1", app_role.schema
        )
        assert owner == app_role.name
        outside = [r[0] for r in await admin.fetch(OWNED_OUTSIDE_SCHEMA, app_role.name, app_role.schema)]
        assert outside == [], f"objects owned by the bus role outside its schema: {outside}"
        not_owned = [r[0] for r in await admin.fetch(IN_SCHEMA_NOT_OWNED, app_role.name, app_role.schema)]
        assert not_owned == [], f"objects in the bus schema owned by someone else: {not_owned}"
        tables = await admin.fetchval(
            "SELECT count(*) FROM pg_class WHERE relnamespace = $1::regnamespace AND relkind = 'r'",
            app_role.schema,
        )
        assert tables >= 10  # the migrations did create the bus's tables, as the role
        assert (
            await admin.fetchval(
                "SELECT count(*) FROM pg_extension WHERE extowner = $1::regrole", app_role.name
            )
            == 0
        )

        # Other schemas untouched: same objects, same owners, same data.
        assert [tuple(r) for r in await admin.fetch(SNAPSHOT_OTHER_SCHEMAS, others)] == before
        rows = await admin.fetch(f"SELECT id, balance FROM {app_role.bystander}.accounts ORDER BY id")
        assert [tuple(r) for r in rows] == [(1, 100), (2, 250)]
    finally:
        await admin.close()


async def test_the_unprivileged_role_cannot_reach_another_schema_through_the_bus(
    app_role: AppRole, dsn: str
) -> None:
    # The bus only ever names its own schema; pointing it at a schema the role may not
    # use fails with a typed error instead of touching it.
    with pytest.raises(bus.StorageUnavailableError, match="refused to create or use schema"):
        async with bus.connect(app_role.dsn, schema=app_role.bystander, **FAST):
            pass
    admin = await asyncpg.connect(dsn)
    try:
        tables = await admin.fetch(
            "SELECT relname FROM pg_class WHERE relnamespace = $1::regnamespace ORDER BY relname",
            app_role.bystander,
        )
        assert [r[0] for r in tables] == ["accounts", "accounts_pkey"]
    finally:
        await admin.close()


async def test_a_role_that_may_not_create_schemas_gets_a_typed_error_and_nothing_is_created(
    app_role: AppRole, dsn: str
) -> None:
    admin = await asyncpg.connect(dsn)
    try:
        db_name = await admin.fetchval("SELECT current_database()")
        await admin.execute(f'REVOKE CREATE ON DATABASE "{db_name}" FROM {app_role.name}')
        with pytest.raises(bus.StorageUnavailableError, match="GRANT CREATE ON DATABASE"):
            async with bus.connect(app_role.dsn, schema=app_role.schema, **FAST):
                pass
        assert (
            await admin.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", app_role.schema) == 0
        )
    finally:
        await admin.close()
