"""The shared validation helpers: one vocabulary for ints, durations and worker ids."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

import bus
from bus.consumer import Retry
from storage.names import MAX_SECONDS, validate_int, validate_seconds, validate_worker_id


@pytest.mark.parametrize("value", [True, False, 1.0, "3", None, 0, 11])
def test_validate_int_refuses_bools_non_ints_and_out_of_range(value: object) -> None:
    with pytest.raises(bus.ValidationError, match=r"max_messages must be an integer from 1 to 10, got"):
        validate_int(value, "max_messages", 1, 10)


def test_validate_int_without_upper_bound() -> None:
    assert validate_int(10**12, "limit", 1) == 10**12
    with pytest.raises(bus.ValidationError, match="limit must be an integer >= 1"):
        validate_int(0, "limit", 1)


@pytest.mark.parametrize("value", [True, math.nan, math.inf, -1, MAX_SECONDS * 2, "5", timedelta(seconds=-1)])
def test_validate_seconds_refuses_bool_nan_inf_and_out_of_range(value: object) -> None:
    with pytest.raises(bus.ValidationError, match="timeout must be"):
        validate_seconds(value, "timeout", allow_zero=True)  # type: ignore[call-overload]


def test_validate_seconds_accepts_numbers_and_timedeltas() -> None:
    assert validate_seconds(timedelta(minutes=2), "ttl") == 120.0
    assert validate_seconds(3, "ttl") == 3.0
    assert validate_seconds(0, "delay", allow_zero=True) == 0.0
    with pytest.raises(bus.ValidationError, match="> 0"):
        validate_seconds(0, "lease_time")
    assert validate_seconds(None, "retention", allow_none=True) is None
    with pytest.raises(bus.ValidationError, match="or None"):
        validate_seconds("x", "retention", allow_none=True)  # type: ignore[call-overload]


def test_one_worker_id_rule() -> None:
    assert validate_worker_id("host-1:pid-42") == "host-1:pid-42"
    for bad in ["", " w", "w;1", 7, None, "-w"]:
        with pytest.raises(bus.ValidationError, match="invalid worker id .*e.g. 'host-1:pid-42'"):
            validate_worker_id(bad)


def test_retry_is_checked_by_the_policy() -> None:
    assert Retry(backoff=timedelta(seconds=1)).policy().backoff == 1.0  # type: ignore[arg-type]
    for bad in [
        Retry(max_attempts=0),
        Retry(backoff=math.nan),
        Retry(max_backoff=-1),
        Retry(max_attempts=True),
    ]:
        with pytest.raises(bus.ValidationError, match="retry"):
            bad.policy()
