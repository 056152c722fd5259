"""FastStream's own broker testcases (tests/faststream/base/, vendored) run on TestBusBroker in memory,
subclassed as FastStream's Redis tests subclass them for TestRedisBroker. A testcase that does not apply to a
broker of this kind is marked here with its reason (docs/faststream.md lists them)."""

from __future__ import annotations

import pytest

from bus.faststream import BusPublishCommand, BusPublisher, BusRoute, _FakeProducer
from tests.faststream.base.codec import CodecTestcase
from tests.faststream.base.fastapi import FastAPILocalTestcase
from tests.faststream.base.middlewares import MiddlewaresOrderTestcase
from tests.faststream.base.publish_command import BatchPublishCommandTestcase
from tests.faststream.base.router import RouterLocalTestcase
from tests.faststream.base.testclient import BrokerTestclientTestcase
from tests.faststream.testcases import (
    BusMemoryTestcaseConfig,
    BusRequestsTestcase,
    FastAPIConfig,
    GroupPerSubscriberRouter,
)


@pytest.mark.asyncio
class TestCodec(BusMemoryTestcaseConfig, CodecTestcase):
    pass


class TestFastAPILocal(FastAPIConfig, BusMemoryTestcaseConfig, FastAPILocalTestcase):
    broker_router_class = GroupPerSubscriberRouter


class TestMiddlewaresOrder(BusMemoryTestcaseConfig, MiddlewaresOrderTestcase):
    pass


class TestPublishCommand(BatchPublishCommandTestcase):
    publish_command_cls = BusPublishCommand


class TestRequestTestClient(BusMemoryTestcaseConfig, BusRequestsTestcase):
    pass


class TestRouterLocal(BusMemoryTestcaseConfig, RouterLocalTestcase):
    route_class = BusRoute
    publisher_class = BusPublisher


@pytest.mark.asyncio
class TestTestclient(BusMemoryTestcaseConfig, BrokerTestclientTestcase):
    @pytest.fixture
    def fake_producer_cls(self) -> type:
        return _FakeProducer
