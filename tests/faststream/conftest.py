"""The fixtures FastStream's shared broker testcases take (FastStream's own tests/conftest.py has them)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from unittest.mock import AsyncMock, MagicMock
from uuid import uuid4

import pytest
from faststream._internal.context import ContextRepo


@pytest.fixture
def queue() -> str:
    return str(uuid4())


@pytest.fixture
def event() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
def event2() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
def event3() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
def mock() -> Iterator[MagicMock]:
    m = MagicMock()
    yield m
    m.reset_mock()


@pytest.fixture
def mock2() -> Iterator[MagicMock]:
    m = MagicMock()
    yield m
    m.reset_mock()


@pytest.fixture
def async_mock() -> Iterator[AsyncMock]:
    m = AsyncMock()
    yield m
    m.reset_mock()


@pytest.fixture
def context() -> ContextRepo:
    return ContextRepo()
