"""Starting Spark for the compaction job: Java 17, the JDBC driver, the JDBC URL.

The PostgreSQL JDBC driver is found, in this order:

1. the `jdbc_jar` argument or the `BUS_JDBC_JAR` environment variable (a path to a jar);
2. Debian's `/usr/share/java/postgresql.jar` (package `libpostgresql-jdbc-java`,
   installed by `scripts/ensure-jdbc.sh`, which `make test` runs);
3. otherwise Spark downloads it from Maven Central through
   `spark.jars.packages=org.postgresql:postgresql:42.7.4` (needs internet).

Java 17 is required. When `JAVA_HOME` is unset it is set to
`/usr/lib/jvm/java-17-openjdk-amd64` (Debian's OpenJDK 17); no other JDK on the
machine is picked up implicitly, and a `JAVA_HOME` that is not Java 17 is an
error saying so.

`spark-submit` runs get `--driver-memory` from `BUS_SPARK_DRIVER_MEMORY`
(default 2g; the in-process session reads the same variable) and, when set,
`--driver-java-options` from `BUS_SPARK_JAVA_OPTS` (default `-XX:+UseParallelGC`:
a batch job wants throughput, and the parallel collector finishes a run
sooner than the default G1). `BUS_SPARK_EXECUTOR_MEMORY`
sets `spark.executor.memory` (cluster masters; Spark's default is 1g).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from storage.errors import BusError, ValidationError
from storage.names import validate_schema

DEBIAN_JAVA_17 = "/usr/lib/jvm/java-17-openjdk-amd64"
DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
JDBC_PACKAGE = "org.postgresql:postgresql:42.7.4"

if TYPE_CHECKING:
    from anyio.abc import ByteReceiveStream


class SparkSetupError(BusError):
    """Spark cannot start here: Java 17 or the JDBC driver is missing (the message says how to fix it)."""


def java_home() -> str:
    """The Java 17 home to use (JAVA_HOME, else Debian's OpenJDK 17); raises SparkSetupError otherwise."""
    home = os.environ.get("JAVA_HOME") or DEBIAN_JAVA_17
    java = Path(home) / "bin" / "java"
    if not java.exists():
        raise SparkSetupError(
            f"Java 17 is required by the compaction job but {java} does not exist; install OpenJDK 17 "
            f"(apt-get install openjdk-17-jre-headless) or set JAVA_HOME to a Java 17 home"
        )
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise SparkSetupError(f"cannot run {java} ({exc}); set JAVA_HOME to a Java 17 home") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    major = (
        None if match is None else int(match.group(1)) if match.group(1) != "1" else int(match.group(2) or 0)
    )
    if major != 17:
        raise SparkSetupError(
            f"Java 17 is required by the compaction job, but {java} is Java {major}; "
            f"set JAVA_HOME to a Java 17 home (e.g. {DEBIAN_JAVA_17})"
        )
    return home


def jdbc_jar(explicit: str | None = None) -> str | None:
    """The driver jar to put on Spark's class path, or None to fetch `JDBC_PACKAGE` from Maven."""
    for candidate in (explicit, os.environ.get("BUS_JDBC_JAR")):
        if candidate:
            if not Path(candidate).is_file():
                raise SparkSetupError(
                    f"the JDBC driver jar {candidate!r} (BUS_JDBC_JAR / jdbc_jar) does not exist"
                )
            return candidate
    if Path(DEBIAN_JDBC_JAR).is_file():
        return DEBIAN_JDBC_JAR
    return None


def jdbc_target(dsn: str, schema: str) -> tuple[str, dict[str, str]]:
    """(JDBC URL, connection properties) for a `postgresql://` DSN; the schema becomes `currentSchema`.

    Credentials travel as properties, not in the URL. The DSN must name a TCP
    host: JDBC cannot use a Unix socket.
    """
    validate_schema(schema)
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValidationError(f"the compaction job needs a postgresql:// DSN, got scheme {parts.scheme!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    host = parts.hostname or query.get("host")
    if not host or host.startswith("/"):
        raise ValidationError(
            "the compaction job reads over JDBC, which needs a TCP host in the DSN "
            "(postgresql://user@127.0.0.1:5432/db), not a Unix socket"
        )
    port = parts.port or int(query.get("port", "5432"))
    database = unquote(parts.path.lstrip("/")) or "postgres"
    props = {
        "driver": "org.postgresql.Driver",
        "user": unquote(parts.username or query.get("user") or os.environ.get("PGUSER", "postgres")),
    }
    password = parts.password or query.get("password") or os.environ.get("PGPASSWORD")
    if password:
        props["password"] = unquote(password)
    if "sslmode" in query:
        props["sslmode"] = query["sslmode"]
    host_part = f"[{host}]" if ":" in host else host
    url = (
        f"jdbc:postgresql://{host_part}:{port}/{database}"
        f"?currentSchema={schema}&ApplicationName=bus-compact&reWriteBatchedInserts=true"
        # Binary transfer from the first execution: each Spark task runs its
        # query once, and below pgjdbc's default threshold (5) results come as
        # text (bytea hex-encoded by the server and decoded again here).
        "&prepareThreshold=-1"
    )
    return url, props


DEFAULT_DRIVER_JAVA_OPTIONS = "-XX:+UseParallelGC"


def driver_java_options() -> str:
    """The driver JVM's options: `BUS_SPARK_JAVA_OPTS`, else `DEFAULT_DRIVER_JAVA_OPTIONS`."""
    return os.environ.get("BUS_SPARK_JAVA_OPTS") or DEFAULT_DRIVER_JAVA_OPTIONS


def submit_command(
    job_args: list[str], *, master: str = "local[*]", jdbc_jar_path: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) to run the job with the pyspark package's own `spark-submit`."""
    import pyspark

    spark_home = str(Path(pyspark.__file__).parent)
    env = {
        **os.environ,
        "SPARK_HOME": spark_home,
        "JAVA_HOME": java_home(),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    if master.startswith("local"):
        # Local runs talk over loopback; skips a host-name lookup at start-up.
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # The driver's JVM is already running when job.py builds its session, so
    # its heap size must be given here, not in the session's config.
    argv = [
        str(Path(spark_home) / "bin" / "spark-submit"),
        "--master",
        master,
        "--driver-memory",
        os.environ.get("BUS_SPARK_DRIVER_MEMORY", "2g"),
    ]
    argv += ["--driver-java-options", driver_java_options()]
    jar = jdbc_jar(jdbc_jar_path)
    argv += ["--jars", jar] if jar else ["--packages", JDBC_PACKAGE]
    job = Path(__file__).with_name("job.py")
    return [*argv, str(job), *job_args], env


async def run_submit(
    job_args: list[str], *, dsn: str, master: str = "local[*]", jdbc_jar_path: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the job with `spark-submit` until it exits: its exit code and output (stdout, stderr).

    The DSN reaches the job as `BUS_DSN` in its environment, never on its command line, which
    every local user can read. spark-submit's JVM starts the Python driver, which starts Python
    workers; they all run in a process group of their own, and a cancelled call (a deadline, a
    shutdown) kills the whole group, not only the launcher, so no driver is left behind holding
    the run's lock and connections.
    """
    import anyio  # here: the job itself (job.py, under spark-submit) imports this module too

    argv, env = submit_command(job_args, master=master, jdbc_jar_path=jdbc_jar_path)
    env["BUS_DSN"] = dsn
    proc = await anyio.open_process(argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    out, err = bytearray(), bytearray()
    try:
        async with anyio.create_task_group() as tg:
            assert proc.stdout is not None and proc.stderr is not None
            tg.start_soon(_drain, proc.stdout, out)
            tg.start_soon(_drain, proc.stderr, err)
            await proc.wait()
    except BaseException:
        # The group's id is the launcher's pid; it cannot be reused while one of the job's processes lives.
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await proc.aclose()
    assert proc.returncode is not None
    return subprocess.CompletedProcess(
        argv, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
    )


async def _drain(stream: ByteReceiveStream, into: bytearray) -> None:
    async for chunk in stream:
        into += chunk


def spark_session(
    master: str | None = None, *, jdbc_jar_path: str | None = None, app_name: str = "bus-compact"
) -> Any:
    """A SparkSession for the job (`master` default `local[*]`), with the JDBC driver and Java 17.

    If a session is already active in this process it is returned as is.
    """
    if not (os.environ.get("PYSPARK_GATEWAY_PORT") and os.environ.get("JAVA_HOME")):
        # Under spark-submit the JVM already runs (on JAVA_HOME): checking
        # its version again would start one more JVM for nothing.
        os.environ["JAVA_HOME"] = java_home()
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SparkSetupError(
            "pyspark is not installed; install the extra: pip install 'pgactorbus[spark]'"
        ) from exc
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder
    # Under spark-submit the master comes from its --master; do not override it.
    if master is not None or not os.environ.get("PYSPARK_GATEWAY_PORT"):
        builder = builder.master(master or "local[*]")
    builder = (
        builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "8")
        # The archive is written partitioned by topic and date: with a writer
        # open per output directory, Spark skips sorting each task's rows
        # (payloads included) by those columns first.
        .config("spark.sql.maxConcurrentOutputFileWriters", "64")
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.driver.memory", os.environ.get("BUS_SPARK_DRIVER_MEMORY", "2g"))
        # Applies when this process starts the JVM (not under spark-submit, whose JVM already runs).
        .config("spark.driver.extraJavaOptions", driver_java_options())
        .config("spark.sql.parquet.compression.codec", "snappy")
    )
    if (master or "local").startswith("local") and not os.environ.get("PYSPARK_PYTHON"):
        # Local Python workers run this interpreter (with pyspark and the bus installed), not the
        # first python3 on PATH (pyspark reads the variable when the context starts); on a
        # cluster the executors' own Python is the deployer's choice.
        os.environ["PYSPARK_PYTHON"] = sys.executable
    executor_memory = os.environ.get("BUS_SPARK_EXECUTOR_MEMORY")
    if executor_memory:
        # On a cluster each executor asks its worker for this much (Spark's default 1g).
        builder = builder.config("spark.executor.memory", executor_memory)
    jar = jdbc_jar(jdbc_jar_path)
    # `spark.jars` ships the driver jar to every executor (they fetch it from the driver).
    builder = (
        builder.config("spark.jars", jar) if jar else builder.config("spark.jars.packages", JDBC_PACKAGE)
    )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
