"""Observability tests: fast group timings and a way to read the bus's metrics."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.observability.helpers import FAST


@pytest.fixture
def fast() -> dict[str, Any]:
    return dict(FAST)


@pytest.fixture
def uniq() -> Callable[[str], str]:
    """Names unique to the test: the registry is process-wide, so labels must not collide between tests."""
    tag = uuid.uuid4().hex[:8]
    return lambda name: f"{name}-{tag}"
