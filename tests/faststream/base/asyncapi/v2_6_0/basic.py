# Copyright 2023 FastStream authors (https://github.com/ag2ai/faststream)
#
# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file except in
# compliance with the License. You may obtain a copy of the License in LICENSE in tests/faststream/base or at
# http://www.apache.org/licenses/LICENSE-2.0. Distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR
# CONDITIONS OF ANY KIND, either express or implied.
#
# FastStream's tests/asyncapi/base/v2_6_0/basic.py, unchanged apart from its imports: FastStream 0.7 (repository commit 7c9a125,
# the 0.7 series after 0.7.4), the shared AsyncAPI testcases of its brokers.

from typing import Any

from faststream import FastStream
from faststream._internal.broker.broker import BrokerUsecase
from faststream.specification import AsyncAPI
from faststream.specification.base import Specification


class AsyncAPI260Factory:
    def get_spec(self, *brokers: BrokerUsecase[Any, Any]) -> Specification:
        factory = AsyncAPI(schema_version="2.6.0")
        for broker in brokers:
            factory.add_broker(broker)
        return factory.to_specification()


def get_2_6_0_spec(broker: BrokerUsecase[Any, Any], **kwargs: Any) -> Specification:
    return FastStream(
        broker,
        specification=AsyncAPI(schema_version="2.6.0", **kwargs),
    ).schema.to_specification()


def get_2_6_0_schema(broker: BrokerUsecase[Any, Any], **kwargs: Any) -> Any:
    return get_2_6_0_spec(broker, **kwargs).to_jsonable()
