"""`bus compact` on a real Spark standalone cluster: a master and two workers on 127.0.0.1.

The cluster is started from the pyspark package's own `bin/spark-class`, kept
small (one core and 512 MiB per worker), and stopped at the end. The result
must be identical to a `local[2]` run on identical data.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import bus
from bus.compaction import run_compaction
from tests.compaction.compaction_model import archive_rows, load, log_starts, make_group, present
from tests.conftest import SPARK_TEST_JAVA_OPTIONS

# Three cluster JVMs, a driver and two executors on a 2-core machine: minutes when it is busy.
pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(900)]

START = datetime(2026, 1, 1, tzinfo=UTC)  # fixed, so both schemas get byte-identical data
STARTUP_TIMEOUT = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: Any, proc: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not check():
        dead = [p for p in proc if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}" for p in logs if p.exists())
            raise AssertionError(f"Spark standalone {what} did not come up\n{tails}")
        time.sleep(0.5)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@dataclass
class Cluster:
    """A running standalone master and its workers."""

    url: str
    work_dirs: list[Path]
    procs: list[subprocess.Popen[bytes]]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A master and two one-core workers on 127.0.0.1; every process is stopped afterwards."""
    import pyspark

    from bus.compaction.spark import java_home

    spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
    env = {
        **os.environ,
        "SPARK_HOME": str(Path(pyspark.__file__).parent),
        "JAVA_HOME": java_home(),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_DAEMON_MEMORY": "256m",
        "PYSPARK_PYTHON": sys.executable,
    }
    if os.environ.get("BUS_CLUSTER_JVM_DEFAULTS") is None:
        # The master, the workers and the executors they start (which inherit the workers'
        # environment) start on the client compiler and the serial collector, as the driver does
        # (tests/conftest.py). BUS_CLUSTER_JVM_DEFAULTS=1 keeps the JVMs' defaults, to compare.
        env["JAVA_TOOL_OPTIONS"] = SPARK_TEST_JAVA_OPTIONS
    port = _free_port()
    url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(name: str, *argv: str) -> None:
        log_file = tmp_path / f"{name}.log"
        logs.append(log_file)
        with open(log_file, "wb") as out:
            # A session of its own: the JVM and anything it forks are stopped together.
            procs.append(
                subprocess.Popen(
                    [spark_class, *argv],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    work_dirs = [tmp_path / "worker-0", tmp_path / "worker-1"]
    try:
        start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(_free_port()),
        )
        _wait("master", lambda: _listening(port), procs, logs)
        for i, work in enumerate(work_dirs):
            start(
                f"worker-{i}",
                "org.apache.spark.deploy.worker.Worker",
                url,
                "--host",
                "127.0.0.1",
                "--cores",
                "1",
                "--memory",
                "512m",
                "--webui-port",
                str(_free_port()),
                "--work-dir",
                str(work),
            )
        _wait(
            "workers",
            lambda: logs[0].read_text(errors="replace").count("Registering worker") >= 2,
            procs,
            logs,
        )
        yield Cluster(url, work_dirs, procs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert all(p.poll() is not None for p in procs)


async def _history(b: bus.Bus) -> None:
    """A compact topic and a delete topic with retention, a group holding part of it back (~10,000 rows)."""
    await b.create_topic("kv", 2, cleanup="compact", tombstone_retention=3600)
    await b.create_topic("orders", 2, retention=86400)
    for p in ("0", "1"):
        await load(b, "kv", p, 3000, keys=100, start=START, step=1.0, tombstone_every=23)
        await load(b, "orders", p, 2000, keys=50, start=START, step=1.0)
    await make_group(b, "g", ["kv", "orders"], {("kv", "0"): 2500, ("orders", "1"): 1500})


async def _outcome(b: bus.Bus, spark: Any, archive: Path) -> tuple[Any, ...]:
    async with b.pool.acquire() as conn:
        left, starts = await present(conn), await log_starts(conn)
    rows = sorted(
        (r["partition_id"], r["offset"], r["digest"], r["topic"], str(r["date"]))
        for r in archive_rows(spark, str(archive))
    )
    return left, starts, rows


async def test_bus_compact_on_a_standalone_cluster_matches_local(
    connect: Any, dsn: str, spark: Any, cluster: Cluster, tmp_path: Path
) -> None:
    on_cluster = await connect(cleaner_interval=0)
    local_schema = "t_" + os.urandom(6).hex()
    local = await connect(schema=local_schema, cleaner_interval=0)
    try:
        await _history(on_cluster)
        await _history(local)
        env = {
            **os.environ,
            "BUS_DSN": dsn,
            "BUS_SCHEMA": on_cluster.config.schema,
            "SPARK_LOCAL_IP": "127.0.0.1",  # executors reach the driver on loopback
            "BUS_SPARK_DRIVER_MEMORY": "512m",
            "BUS_SPARK_EXECUTOR_MEMORY": "512m",
            "BUS_COMPACT_SPLIT_ROWS": "1000",  # several read tasks, so both executors get work
        }
        argv = [
            sys.executable,
            "-m",
            "bus",
            "compact",
            "--master",
            cluster.url,
            "--archive",
            str(tmp_path / "c"),
        ]
        # The local reference run goes on while the cluster's job runs (separate schemas and archives):
        # the cluster job mostly waits on its JVMs starting and its executors registering.
        proc, _ = await asyncio.gather(
            asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=600),
            asyncio.to_thread(
                run_compaction, local.dsn, local_schema, spark=spark, archive=str(tmp_path / "l")
            ),
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        got, want = (
            await _outcome(on_cluster, spark, tmp_path / "c"),
            await _outcome(local, spark, tmp_path / "l"),
        )
        assert got == want and len(got[2]) > 3000
    finally:
        conn = await local.pool.acquire()
        try:
            await conn.execute(f'DROP SCHEMA "{local_schema}" CASCADE')  # generated name
        finally:
            await local.pool.release(conn)
    # The executors on the workers ran the JDBC reads and wrote the archive:
    # each fetched the driver jar from the driver and finished tasks.
    executor_logs = [
        p.read_text(errors="replace") for w in cluster.work_dirs for p in w.glob("app-*/*/stderr")
    ]
    ran = [text for text in executor_logs if "Finished task" in text]
    assert ran, "no executor on the cluster ran a task"
    assert all("postgresql.jar" in text for text in ran)
