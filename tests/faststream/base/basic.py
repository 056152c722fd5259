# Copyright 2023 FastStream authors (https://github.com/ag2ai/faststream)
#
# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file except in
# compliance with the License. You may obtain a copy of the License in LICENSE beside this file or at
# http://www.apache.org/licenses/LICENSE-2.0. Distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR
# CONDITIONS OF ANY KIND, either express or implied.
#
# FastStream's tests/brokers/base/basic.py, unchanged apart from its imports: FastStream 0.7
# (repository commit 7c9a125df, the 0.7 series after 0.7.4), the shared testcases of its brokers.

from abc import abstractmethod
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, Generic, overload

from typing_extensions import TypeVar

from faststream._internal.broker import BrokerUsecase
from faststream._internal.broker.router import BrokerRouter

_BrokerT = TypeVar("_BrokerT", bound=BrokerUsecase[Any, Any], default=Any)


class BaseTestcaseConfig(Generic[_BrokerT]):
    timeout: float = 3.0
    # Default channel/list/core subscribers that force MANUAL ack have no
    # AcknowledgementMiddleware, so cancel cannot hit the shared ack skip path.
    supports_cancel_ack_skip: bool = True

    @abstractmethod
    def get_broker(
        self,
        apply_types: bool = False,
        **kwargs: Any,
    ) -> _BrokerT:
        raise NotImplementedError

    @overload
    def patch_broker(
        self,
        brokers: _BrokerT,
        **kwargs: Any,
    ) -> AbstractAsyncContextManager[_BrokerT]: ...

    @overload
    def patch_broker(
        self,
        *brokers: _BrokerT,
        **kwargs: Any,
    ) -> AbstractAsyncContextManager[tuple[_BrokerT, ...]]: ...

    def patch_broker(
        self,
        *brokers: _BrokerT,
        **kwargs: Any,
    ) -> Any:
        if len(brokers) == 1:
            return brokers[0]

        @asynccontextmanager
        async def enter_broker() -> AsyncGenerator[list[BrokerUsecase], None]:
            started_brokers = []

            async with AsyncExitStack() as stack:
                for br in brokers:
                    started_brokers.append(await stack.enter_async_context(br))  # noqa: PERF401

                yield tuple(started_brokers)

        return enter_broker()

    def get_subscriber_params(
        self,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[
        tuple[Any, ...],
        dict[str, Any],
    ]:
        return args, kwargs

    def get_cancel_ack_subscriber_kwargs(self, queue: str) -> dict[str, Any]:
        """Extra subscriber kwargs for cancel acknowledgement-skip consume tests."""
        return {}

    @abstractmethod
    def get_router(self, **kwargs: Any) -> BrokerRouter:
        raise NotImplementedError
