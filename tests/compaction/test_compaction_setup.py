"""Quick checks that need no Spark: the JDBC target, Java 17, the driver jar, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

import bus
from bus.compaction import SparkSetupError, jdbc_target, run_compaction
from bus.compaction.archive import split_ranges
from bus.compaction.command import parse_every
from bus.compaction.spark import java_home, jdbc_jar
from storage.compaction.sql import split_predicate
from storage.errors import ValidationError

TEMURIN_25 = Path("/usr/lib/jvm/temurin-25-jdk-amd64")


def test_a_tcp_dsn_becomes_a_jdbc_url_on_the_schema_with_credentials_as_properties() -> None:
    url, props = jdbc_target("postgresql://bob:s%40cret@127.0.0.1:5433/app?sslmode=disable", "t_abc")
    assert url.startswith("jdbc:postgresql://127.0.0.1:5433/app?currentSchema=t_abc&")
    assert "bob" not in url and "cret" not in url
    assert props["user"] == "bob" and props["password"] == "s@cret" and props["sslmode"] == "disable"
    assert props["driver"] == "org.postgresql.Driver"


def test_a_unix_socket_dsn_is_refused_with_a_hint_about_tcp() -> None:
    with pytest.raises(ValidationError, match="TCP host"):
        jdbc_target("postgresql://postgres@/postgres?host=/tmp/sock", "bus")


def test_an_invalid_schema_is_refused_before_anything_runs() -> None:
    with pytest.raises(ValidationError, match="invalid schema"):
        jdbc_target("postgresql://postgres@127.0.0.1:5432/postgres", "bus; DROP TABLE x")


def test_a_java_home_that_is_not_java_17_is_refused_with_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    if not TEMURIN_25.exists():
        pytest.skip("no second JDK on this machine to point JAVA_HOME at")
    monkeypatch.setenv("JAVA_HOME", str(TEMURIN_25))
    with pytest.raises(SparkSetupError, match="Java 17 is required.*Java 25"):
        java_home()


def test_a_missing_java_home_is_refused_with_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nojava"))
    with pytest.raises(SparkSetupError, match="OpenJDK 17"):
        java_home()


def test_without_java_home_debian_java_17_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/usr/lib/jvm/java-17-openjdk-amd64/bin/java").exists():
        pytest.skip("Debian's OpenJDK 17 is not installed")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    assert java_home() == "/usr/lib/jvm/java-17-openjdk-amd64"


def test_a_configured_jdbc_jar_that_does_not_exist_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BUS_JDBC_JAR", str(tmp_path / "missing.jar"))
    with pytest.raises(SparkSetupError, match="does not exist"):
        jdbc_jar()


def test_a_configured_jdbc_jar_wins_over_the_system_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    jar = tmp_path / "driver.jar"
    jar.write_bytes(b"PK")
    monkeypatch.setenv("BUS_JDBC_JAR", str(jar))
    assert jdbc_jar() == str(jar)


def test_read_splits_are_whole_partitions_or_offset_ranges_of_integers_only() -> None:
    assert split_predicate([(3, None, None), (5, None, None)]) == "partition_id IN (3, 5)"
    assert split_predicate([(3, None, None), (7, None, 120)]) == (
        '(partition_id IN (3)) OR (partition_id = 7 AND "offset" < 120)'
    )
    assert split_predicate([(7, 120, 300)]) == 'partition_id = 7 AND "offset" >= 120 AND "offset" < 300'
    assert split_predicate([(7, 300, None)]) == 'partition_id = 7 AND "offset" >= 300'
    for bad in ("1'; DROP TABLE messages; --", -1, 1.5, True):
        with pytest.raises(ValueError):
            split_predicate([(7, bad, None)])  # type: ignore[list-item]
        with pytest.raises(ValueError):
            split_predicate([(bad, None, None)])  # type: ignore[list-item]


def test_planned_ranges_split_into_even_spans_covering_every_offset_once() -> None:
    ranges = [(1, 0, 100), (2, 50, 60), (3, 10, 400)]
    for tasks in (1, 2, 3, 7, 1000):
        spans = split_ranges(ranges, tasks)
        assert 1 <= len(spans) <= tasks
        covered: list[tuple[int, int]] = []
        for span in spans:
            for pid, lo, hi in span:
                planned = next(r for r in ranges if r[0] == pid)
                covered += [
                    (pid, o)
                    for o in range(planned[1] if lo is None else lo, planned[2] if hi is None else hi)
                ]
        assert sorted(covered) == sorted((pid, o) for pid, lo, hi in ranges for o in range(lo, hi))
        sizes = [
            sum(
                (r[2] if hi is None else hi) - (r[1] if lo is None else lo)
                for pid, lo, hi in span
                for r in ranges
                if r[0] == pid
            )
            for span in spans
        ]
        assert max(sizes) - min(sizes) <= max(sizes) // 2 + 1 or len(spans) == 1
    assert split_ranges([(1, 5, 5)], 4) == []
    assert split_ranges(ranges, 1) == [[(1, None, None), (2, None, None), (3, None, None)]]


def test_an_invalid_topic_name_is_refused() -> None:
    with pytest.raises(ValidationError, match="topic name"):
        run_compaction("postgresql://postgres@127.0.0.1:5432/postgres", "bus", topics=["bad name;"])


@pytest.mark.parametrize(
    "text,seconds", [("10m", 600), ("90s", 90), ("1h30m", 5400), ("45", 45), ("0.5s", 0.5)]
)
def test_every_takes_a_duration(text: str, seconds: float) -> None:
    assert parse_every(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "ten minutes", "-5m", "5d"])
def test_every_refuses_what_is_not_a_positive_duration(text: str) -> None:
    with pytest.raises(bus.ValidationError, match="--every"):
        parse_every(text)
