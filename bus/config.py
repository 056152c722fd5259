"""Bus configuration: keyword arguments of `connect()`, else `BUS_*` environment variables, else defaults."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from storage.errors import ValidationError
from storage.names import MAX_SECONDS, validate_name, validate_schema

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024

#: Short timings for tests and the demo's `--fast` run: heartbeats every 0.2 s, sessions of 1.5 s,
#: rebalances after 0.05 s, the poll fallback every 0.25 s. `bus.testing.FAST` is this.
FAST_TIMINGS: dict[str, float] = {
    "heartbeat_interval": 0.2,
    "session_timeout": 1.5,
    "rebalance_delay": 0.05,
    "max_poll_interval": 0.25,
    "lease_time": 5.0,
}


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """Every tunable of a Bus. Times are seconds."""

    schema: str = "bus"
    heartbeat_interval: float = 3.0
    session_timeout: float = 10.0
    rebalance_delay: float = 0.5
    lease_time: float = 30.0
    max_poll_interval: float = 2.0
    default_start: str = "earliest"
    new_lookback: float | None = None
    group_heartbeat_timeout: float = 300.0
    claim_ttl: float = 120.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    pool_min_size: int = 2
    pool_max_size: int = 20
    cleaner_interval: float = 5.0
    # The scheduler of periodic jobs (actors/scheduler.py): how often it renews its lease and looks
    # for due ticks (a due tick wakes it sooner); 0 (or less) runs no scheduler in this process.
    scheduler_interval: float = 1.0
    # The Producer (actors/producer.py): how pool publishes are gathered into one write.
    linger: float = 0.0
    max_batch: int = 1000
    max_batch_bytes: int = 8 * 1024 * 1024
    # Where the bus runs: through a pooler (None: directly; "session"; "transaction": no session state
    # on pooled connections) and the direct DSN its LISTEN connection uses then (without it, polling).
    pooler: str | None = None
    direct_dsn: str | None = None
    # How often readers look for work when no wake-up can come by LISTEN (a transaction pooler, no direct_dsn).
    poll_interval: float = 0.25
    # A name for this process's workflow executor that survives its restarts (a StatefulSet pod's
    # name, a systemd unit instance); no two running processes may share it. A process started
    # under it takes back at once the runs it was executing when it died. None: a name of its own
    # per Bus, and a dead process's runs are taken over when their leases (`lease_time`) lapse.
    workflow_executor: str | None = None

    @property
    def listens(self) -> bool:
        """Whether wake-ups come by LISTEN (False: through a transaction pooler without a direct DSN)."""
        return self.pooler != "transaction" or self.direct_dsn is not None

    @property
    def fallback_poll(self) -> float:
        """How long a reader with nothing to do waits before it looks again by itself."""
        return self.max_poll_interval if self.listens else min(self.max_poll_interval, self.poll_interval)

    @property
    def lookback(self) -> float:
        """How far before a `latest` group's start it still reads (default 2 × max_poll_interval)."""
        return self.new_lookback if self.new_lookback is not None else 2 * self.max_poll_interval

    @classmethod
    def load(cls, overrides: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
        """Build a Config from `overrides` over `BUS_*` variables; a ValidationError names the bad key."""
        env = os.environ if environ is None else environ
        fields = set(cls.__struct_fields__)
        unknown = set(overrides) - fields
        if unknown:
            raise ValidationError(
                f"unknown configuration key(s) {sorted(unknown)}; valid keys are {sorted(fields)}"
            )
        values: dict[str, Any] = {}
        for name in fields:
            var = f"BUS_{name.upper()}"
            if var in env and env[var] != "":
                values[name] = env[var]
        values.update({k: v for k, v in overrides.items() if v is not None or k == "new_lookback"})
        try:
            config = msgspec.convert(values, cls, strict=False)
        except (msgspec.ValidationError, UnicodeEncodeError) as exc:  # str -> number parses via UTF-8
            raise ValidationError(f"invalid configuration: {exc}") from exc
        config._check_times()
        config._check_sizes()
        return config

    def _check_times(self) -> None:
        """Refuse a schema name, durations and a start that no Bus can run with."""
        validate_schema(self.schema)
        for name in ("heartbeat_interval", "session_timeout", "lease_time", "max_poll_interval"):
            if not 0 < getattr(self, name) <= MAX_SECONDS:  # also refuses NaN and infinity
                raise ValidationError(f"invalid configuration: {name} must be > 0 (and finite)")
        if self.heartbeat_interval >= self.session_timeout:
            raise ValidationError(
                "invalid configuration: heartbeat_interval must be shorter than session_timeout"
            )
        if self.default_start not in ("earliest", "latest"):
            raise ValidationError("invalid configuration: default_start must be 'earliest' or 'latest'")
        for name in ("rebalance_delay", "group_heartbeat_timeout", "claim_ttl", "new_lookback"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_SECONDS:
                raise ValidationError(
                    f"invalid configuration: {name} must be a finite number of seconds >= 0"
                )
        if not self.cleaner_interval <= MAX_SECONDS:  # <= 0 disables the cleaner; NaN/inf are mistakes
            raise ValidationError(
                "invalid configuration: cleaner_interval must be finite (0 or less disables it)"
            )
        if not self.scheduler_interval <= MAX_SECONDS:  # <= 0 runs no scheduler; NaN/inf are mistakes
            raise ValidationError(
                "invalid configuration: scheduler_interval must be finite (0 or less runs no scheduler)"
            )
        if self.pooler not in (None, "session", "transaction"):
            raise ValidationError(
                f"invalid configuration: pooler must be None, 'session' or 'transaction', not {self.pooler!r}"
            )
        if self.workflow_executor is not None:
            validate_name(self.workflow_executor, "workflow_executor")
        if not 0 < self.poll_interval <= MAX_SECONDS:
            raise ValidationError("invalid configuration: poll_interval must be > 0 (and finite)")
        if not 0 <= self.linger <= 10:
            raise ValidationError("invalid configuration: linger must be 0 to 10 seconds (0: no added wait)")

    def _check_sizes(self) -> None:
        """Refuse message, batch and pool sizes out of their ranges."""
        if not 0 < self.max_message_bytes <= 1 << 30:
            raise ValidationError("invalid configuration: max_message_bytes must be > 0 and at most 1 GiB")
        if not 1 <= self.max_batch <= 100_000 or not 1024 <= self.max_batch_bytes <= 1 << 30:
            raise ValidationError(
                "invalid configuration: max_batch must be 1 to 100000 messages, max_batch_bytes 1 KiB to 1 GiB"
            )
        if not 0 <= self.pool_min_size <= self.pool_max_size <= 10_000 or self.pool_max_size < 1:
            raise ValidationError(
                "invalid configuration: need 0 <= pool_min_size <= pool_max_size <= 10000, pool_max_size >= 1"
            )
