"""How FastStream's shared broker testcases run on BusBroker: the real broker on PostgreSQL, and
TestBusBroker in memory, as FastStream's Redis tests configure RedisBroker and TestRedisBroker.

The testcases subscribe as FastStream's other brokers are subscribed: `broker.subscriber(queue)`
with no more arguments. On the bus a pubsub subscriber needs a consumer group, so the broker the
testcases get gives each subscriber without one a group of its own (every subscriber gets every
message, as on Redis pub/sub) that starts at the topic's earliest message, and creates the topics
they use on first use (`create_topics=True`).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import msgspec
import pytest
from faststream import BaseMiddleware

from bus.faststream import BusBroker, BusRouter, TestBusBroker
from bus.faststream.fastapi import BusRouter as FastAPIBusRouter
from bus.testing import FAST
from tests.faststream.base.basic import BaseTestcaseConfig
from tests.faststream.base.requests import RequestsTestcase

_groups = itertools.count()

# In-memory testcases that also start the broker for real (on the test's schema).
_STARTS_FOR_REAL = frozenset({"test_broker_gets_patched_attrs_within_cm"})


class GroupPerSubscriberBroker(BusBroker):
    """A BusBroker whose subscribers without a group get one of their own, reading from the start."""

    def subscriber(self, topic: str, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs.setdefault("group", f"g{next(_groups)}")
        kwargs.setdefault("start", "earliest")
        return super().subscriber(topic, **kwargs)


class GroupPerSubscriberRouter(BusRouter):
    """The router of the same: each subscriber without a group gets one of its own."""

    def subscriber(self, topic: str, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs.setdefault("group", f"g{next(_groups)}")
        kwargs.setdefault("start", "earliest")
        return super().subscriber(topic, **kwargs)


class BusTestcaseConfig(BaseTestcaseConfig[BusBroker]):
    """The real broker, on the test's own schema."""

    timeout: float = 3.0
    _dsn: str | None = None
    _schema: str | None = None

    @pytest.fixture(autouse=True)
    def _database(self, dsn: str, schema: str, drop_schema: None) -> None:
        self._dsn, self._schema = dsn, schema

    def get_broker(self, apply_types: bool = False, **kwargs: Any) -> BusBroker:
        kwargs.setdefault("create_topics", True)
        return GroupPerSubscriberBroker(
            self._dsn, schema=self._schema, apply_types=apply_types, **FAST, **kwargs
        )

    def get_router(self, **kwargs: Any) -> BusRouter:
        return GroupPerSubscriberRouter(**kwargs)


class BusMemoryTestcaseConfig(BusTestcaseConfig):
    """TestBusBroker in memory (and `with_real=True` on the test's own schema, where a test asks)."""

    @pytest.fixture(autouse=True)
    def _database(self, request: pytest.FixtureRequest, dsn: str, schema: str) -> None:
        self._dsn, self._schema = dsn, schema
        if "real" in request.node.name or request.node.name in _STARTS_FOR_REAL:
            request.getfixturevalue("drop_schema")

    def patch_broker(self, *brokers: Any, **kwargs: Any) -> Any:
        return TestBusBroker(*brokers, **kwargs)


class FastAPIGroupPerSubscriberRouter(FastAPIBusRouter):
    broker_class = GroupPerSubscriberBroker


class FastAPIConfig:
    router_class: Any

    @pytest.fixture(autouse=True)
    def _router_class(self, dsn: str, schema: str) -> None:
        self.router_class = functools.partial(
            FastAPIGroupPerSubscriberRouter, dsn, schema=schema, create_topics=True, **FAST
        )


class Mid(BaseMiddleware):
    """Doubles the request's body on receive and again in the consume scope (FastStream's Redis test's)."""

    async def on_receive(self) -> None:
        self.msg = msgspec.structs.replace(self.msg, payload=(self.msg.payload or b"") * 2)

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        msg.body *= 2
        return await call_next(msg)


class BusRequestsTestcase(RequestsTestcase):
    def get_middleware(self, **kwargs: Any) -> Any:
        return Mid
