"""Observability tests: labels unique to each test (the metrics registry is process-wide)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest


@pytest.fixture
def uniq() -> Callable[[str], str]:
    """Names unique to the test: the registry is process-wide, so labels must not collide between tests."""
    tag = uuid.uuid4().hex[:8]
    return lambda name: f"{name}-{tag}"
