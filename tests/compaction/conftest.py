"""One local Spark session for every compaction test (a fresh start costs seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def _spark_missing() -> str | None:
    from bus.compaction.spark import SparkSetupError, java_home, jdbc_jar

    try:
        java_home()
    except SparkSetupError as exc:
        return str(exc)
    try:
        if jdbc_jar() is None:
            return "no PostgreSQL JDBC driver: install libpostgresql-jdbc-java (scripts/ensure-jdbc.sh) or set BUS_JDBC_JAR"
    except SparkSetupError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A `local[2]` SparkSession shared by the whole test session; skips when Java 17 or the driver is missing."""
    reason = _spark_missing()
    if reason:
        pytest.skip(reason)
    from bus.compaction.spark import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()


@pytest.fixture
async def b(connect: Any) -> Any:
    """A Bus on a fresh schema whose retention cleaner is off: the job, not the cleaner, removes history here."""
    return await connect(cleaner_interval=0)
