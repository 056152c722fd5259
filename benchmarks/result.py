"""One measured number, next to the baseline measured in the same run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Result:
    """A benchmark row: `value` of the bus and `baseline` of its peer, both from this run.

    `higher_is_better` says which way the ratio reads (throughput: True;
    latency, time, cost: False). `ratio` is value / baseline.
    """

    scenario: str  # "publish", "groups", "queue", ...
    name: str  # "single, 8 publishers"
    value: float
    unit: str  # "msg/s", "ms", "s", "MiB"
    baseline: float | None = None
    baseline_name: str | None = None  # "raw asyncpg", "pgqueuer", ...
    higher_is_better: bool = True
    target: str | None = None  # "≥ 0.8× raw"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d
