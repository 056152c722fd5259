"""FastStream's own broker testcases (tests/faststream/base/, vendored) run on BusBroker: the real
broker on PostgreSQL and TestBusBroker in memory, subclassed as FastStream's Redis tests subclass
them for RedisBroker and TestRedisBroker. A testcase that does not apply to a broker of this kind is
marked here with its reason (docs/faststream.md lists them)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from faststream import BaseMiddleware

from bus.faststream import BusPublishCommand, BusPublisher, BusRoute, _FakeProducer
from bus.faststream.fastapi import BusRouter as FastAPIBusRouter
from tests.faststream.base.codec import CodecTestcase
from tests.faststream.base.consume import BrokerRealConsumeTestcase
from tests.faststream.base.fastapi import FastAPILocalTestcase, FastAPITestcase
from tests.faststream.base.include_router import IncludePublisherTestcase, IncludeSubscriberTestcase
from tests.faststream.base.middlewares import (
    ExceptionMiddlewareTestcase,
    MiddlewaresOrderTestcase,
    MiddlewareTestcase,
)
from tests.faststream.base.parser import CustomParserTestcase
from tests.faststream.base.publish import BrokerPublishTestcase
from tests.faststream.base.publish_command import BatchPublishCommandTestcase
from tests.faststream.base.requests import RequestsTestcase
from tests.faststream.base.router import RouterLocalTestcase, RouterTestcase
from tests.faststream.base.testclient import BrokerTestclientTestcase
from tests.faststream.testcases import (
    BusMemoryTestcaseConfig,
    BusTestcaseConfig,
    GroupPerSubscriberBroker,
    GroupPerSubscriberRouter,
)


class _FastAPIRouter(FastAPIBusRouter):
    broker_class = GroupPerSubscriberBroker


class _FastAPIConfig:
    router_class: Any

    @pytest.fixture(autouse=True)
    def _router_class(self, dsn: str, schema: str) -> None:
        from bus.testing import FAST

        self.router_class = functools.partial(_FastAPIRouter, dsn, schema=schema, create_topics=True, **FAST)


class Mid(BaseMiddleware):
    """Doubles the request's body on receive and again in the consume scope (FastStream's Redis test's)."""

    async def on_receive(self) -> None:
        import msgspec

        self.msg = msgspec.structs.replace(self.msg, payload=(self.msg.payload or b"") * 2)

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        msg.body *= 2
        return await call_next(msg)


class BusRequestsTestcase(RequestsTestcase):
    def get_middleware(self, **kwargs: Any) -> Any:
        return Mid


@pytest.mark.asyncio
class TestCodec(BusMemoryTestcaseConfig, CodecTestcase):
    pass


@pytest.mark.asyncio
class TestConsume(BusTestcaseConfig, BrokerRealConsumeTestcase):
    pass


class TestFastAPI(_FastAPIConfig, BusTestcaseConfig, FastAPITestcase):
    broker_router_class = GroupPerSubscriberRouter


class TestFastAPILocal(_FastAPIConfig, BusMemoryTestcaseConfig, FastAPILocalTestcase):
    broker_router_class = GroupPerSubscriberRouter


class TestIncludeSubscriber(BusTestcaseConfig, IncludeSubscriberTestcase):
    pass


class TestIncludePublisher(BusTestcaseConfig, IncludePublisherTestcase):
    pass


class TestMiddlewaresOrder(BusMemoryTestcaseConfig, MiddlewaresOrderTestcase):
    pass


class TestMiddlewares(BusTestcaseConfig, MiddlewareTestcase):
    pass


class TestExceptionMiddlewares(BusTestcaseConfig, ExceptionMiddlewareTestcase):
    pass


class TestCustomParser(BusTestcaseConfig, CustomParserTestcase):
    pass


@pytest.mark.asyncio
class TestPublish(BusTestcaseConfig, BrokerPublishTestcase):
    pass


class TestPublishCommand(BatchPublishCommandTestcase):
    publish_command_cls = BusPublishCommand


class TestRealRequests(BusTestcaseConfig, BusRequestsTestcase):
    pass


class TestRequestTestClient(BusMemoryTestcaseConfig, BusRequestsTestcase):
    pass


class TestRouter(BusTestcaseConfig, RouterTestcase):
    route_class = BusRoute
    publisher_class = BusPublisher


class TestRouterLocal(BusMemoryTestcaseConfig, RouterLocalTestcase):
    route_class = BusRoute
    publisher_class = BusPublisher


@pytest.mark.asyncio
class TestTestclient(BusMemoryTestcaseConfig, BrokerTestclientTestcase):
    @pytest.fixture
    def fake_producer_cls(self) -> type:
        return _FakeProducer
