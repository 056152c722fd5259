"""Logging: importing and using the bus configures nothing global; its events carry bound context."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import uuid

import asyncpg
import structlog

import bus

_PROBE = textwrap.dedent(
    """
    import asyncio, json, logging, sys
    import structlog

    root_before = list(logging.getLogger().handlers)
    import bus
    import bus.cli  # the CLI module configures logging only when it runs

    def state():
        return {
            "structlog_configured": structlog.is_configured(),
            "root_handlers_added": len(logging.getLogger().handlers) - len(root_before),
            "root_level": logging.getLogger().level,
        }

    after_import = state()

    async def main():
        async with bus.connect(sys.argv[1], schema=sys.argv[2]) as b:
            await b.create_topic("t")
            await b.publish("t", b"x")
            await b.read("t")
        after_use = state()
        # A service that configures structlog after importing the bus gets the bus's events.
        seen = []

        def collect(logger, method, event_dict):
            seen.append(event_dict)
            raise structlog.DropEvent

        structlog.configure(processors=[collect])
        logging.getLogger().setLevel(logging.DEBUG)
        async with bus.connect(sys.argv[1], schema=sys.argv[3]):
            pass
        events = [{k: v for k, v in e.items() if isinstance(v, (str, int))} for e in seen]
        print(json.dumps({"after_import": after_import, "after_use": after_use, "events": events}))

    asyncio.run(main())
    """
)


async def test_importing_and_using_the_bus_configures_no_logging_and_prints_nothing(dsn: str) -> None:
    schemas = ["t_" + uuid.uuid4().hex[:12] for _ in range(2)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _PROBE,
        dsn,
        *schemas,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        conn = await asyncpg.connect(dsn)
        for s in schemas:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
        await conn.close()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == 1, f"the library printed to stdout: {lines[:-1]}"
    report = json.loads(lines[0])
    untouched = {"structlog_configured": False, "root_handlers_added": 0, "root_level": 30}
    assert report["after_import"] == untouched
    assert report["after_use"] == untouched
    # Events reached the service's own structlog configuration, with their bound context.
    applied = [e for e in report["events"] if e["event"] == "migration_applied"]
    assert applied and all(e["schema"] == schemas[1] and isinstance(e["version"], int) for e in applied)
    connected = [e for e in report["events"] if e["event"] == "bus_connected"]
    assert connected and connected[0]["schema"] == schemas[1]


async def test_library_events_carry_their_bound_context(dsn: str) -> None:
    schema = "t_" + uuid.uuid4().hex[:12]  # a new schema: its migrations are logged
    try:
        with structlog.testing.capture_logs() as events:
            async with bus.connect(dsn, schema=schema):
                pass
    finally:
        conn = await asyncpg.connect(dsn)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()
    applied = [e for e in events if e["event"] == "migration_applied"]
    assert [e["version"] for e in applied] == sorted(e["version"] for e in applied)
    assert all(e["schema"] == schema and e["name"] for e in applied)
    assert any(e["event"] == "bus_connected" and e["schema"] == schema for e in events)


def test_without_structlog_configured_events_are_plain_text_with_plain_tracebacks() -> None:
    """structlog's development defaults render exceptions with rich and their locals, which held a
    busy event loop for seconds; the library's events go to stdlib logging as plain text instead."""
    import subprocess

    probe = textwrap.dedent(
        """
        import logging, sys
        from storage.logs import get_logger
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(message)s")
        log = get_logger("bus.probe", group="g")
        log.debug("hidden")
        try:
            1 / 0
        except ZeroDivisionError:
            log.exception("boom", partition="3")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "ERROR event='boom'" in out and "group='g'" in out and "partition='3'" in out
    assert "Traceback (most recent call last)" in out and "ZeroDivisionError" in out
    assert out.count("Traceback (most recent call last)") == 1
    assert "hidden" not in out


_TREE_PROBE = textwrap.dedent(
    """
    import asyncio, json, logging, sys
    import bus

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelname, record.getMessage()))

    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)

    async def main():
        async with bus.connect(sys.argv[1], schema=sys.argv[2]) as b:   # a new schema: every migration
            await b.create_topic("t")
        async with bus.connect(sys.argv[1], schema=sys.argv[2]):        # migrated already
            pass
        at_info = list(records)
        records.clear()
        logging.getLogger().setLevel(logging.DEBUG)
        logging.getLogger("bus").setLevel(logging.WARNING)   # one switch for the whole library
        async with bus.connect(sys.argv[1], schema=sys.argv[3]) as b:
            await b.create_topic("t")
        silenced = list(records)
        records.clear()
        logging.getLogger("bus").setLevel(logging.DEBUG)
        async with bus.connect(sys.argv[1], schema=sys.argv[4]):
            pass
        print(json.dumps({"info": at_info, "silenced": silenced, "debug": records}))

    asyncio.run(main())
    """
)


async def test_one_logger_tree_and_one_info_line_per_connect(dsn: str) -> None:
    schemas = ["t_" + uuid.uuid4().hex[:12] for _ in range(3)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _TREE_PROBE, dsn, *schemas,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        conn = await asyncpg.connect(dsn)
        for s in schemas:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
        await conn.close()
    assert proc.returncode == 0, err.decode()
    report = json.loads(out.decode().splitlines()[-1])
    # At INFO, a connect says one thing: how many migrations it applied.
    assert [(lvl, "migrations_applied" in msg) for _, lvl, msg in report["info"]] == [
        ("INFO", True),
        ("INFO", True),
    ], report["info"]
    assert "count=" in report["info"][0][2] and "count=0" in report["info"][1][2]
    assert "count=0" not in report["info"][0][2]
    assert report["silenced"] == []
    # Every event of the library (storage, actors, the facade) is under the `bus` logger.
    names = {name for name, _, _ in report["debug"]}
    assert any(n.startswith("bus.storage.") for n in names), names
    assert all(n == "bus" or n.startswith("bus.") for n in names), names
    assert sum("migration_applied" in msg for _, _, msg in report["debug"]) >= 20
