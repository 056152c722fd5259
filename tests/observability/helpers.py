"""Helpers of the observability tests: metric samples."""

from __future__ import annotations

import bus.metrics


def value(name: str, **labels: str) -> float:
    """One sample of the bus registry (0.0 when absent)."""
    return bus.metrics.value(name, **labels)
