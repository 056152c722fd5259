"""Fast timings for group tests: short sessions, short debounce, short poll fallback."""

from __future__ import annotations

from typing import Any

import pytest

FAST: dict[str, Any] = dict(
    heartbeat_interval=0.2,
    session_timeout=1.5,
    rebalance_delay=0.1,
    max_poll_interval=0.5,
    lease_time=5.0,
)


@pytest.fixture
def fast() -> dict[str, Any]:
    return dict(FAST)
