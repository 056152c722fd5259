"""FastStream's own broker testcases (tests/faststream/base/, vendored) run on the real broker on PostgreSQL (marked slow: a group joins and a schema per test),
subclassed as FastStream's Redis tests subclass them for RedisBroker. A testcase that does not apply to a
broker of this kind is marked here with its reason (docs/faststream.md lists them)."""

from __future__ import annotations

import pytest

from bus.faststream import BusPublisher, BusRoute
from tests.faststream.base.consume import BrokerRealConsumeTestcase
from tests.faststream.base.fastapi import FastAPITestcase
from tests.faststream.base.include_router import IncludePublisherTestcase, IncludeSubscriberTestcase
from tests.faststream.base.middlewares import ExceptionMiddlewareTestcase, MiddlewareTestcase
from tests.faststream.base.parser import CustomParserTestcase
from tests.faststream.base.publish import BrokerPublishTestcase
from tests.faststream.base.router import RouterTestcase
from tests.faststream.testcases import (
    BusRequestsTestcase,
    BusTestcaseConfig,
    FastAPIConfig,
    GroupPerSubscriberRouter,
)

pytestmark = pytest.mark.slow


@pytest.mark.asyncio
class TestConsume(BusTestcaseConfig, BrokerRealConsumeTestcase):
    pass


class TestFastAPI(FastAPIConfig, BusTestcaseConfig, FastAPITestcase):
    broker_router_class = GroupPerSubscriberRouter


class TestIncludeSubscriber(BusTestcaseConfig, IncludeSubscriberTestcase):
    pass


class TestIncludePublisher(BusTestcaseConfig, IncludePublisherTestcase):
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


class TestRealRequests(BusTestcaseConfig, BusRequestsTestcase):
    pass


class TestRouter(BusTestcaseConfig, RouterTestcase):
    route_class = BusRoute
    publisher_class = BusPublisher
