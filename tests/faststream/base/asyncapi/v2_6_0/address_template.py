# Copyright 2023 FastStream authors (https://github.com/ag2ai/faststream)
#
# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file except in
# compliance with the License. You may obtain a copy of the License in LICENSE in tests/faststream/base or at
# http://www.apache.org/licenses/LICENSE-2.0. Distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR
# CONDITIONS OF ANY KIND, either express or implied.
#
# FastStream's tests/asyncapi/base/v2_6_0/address_template.py, unchanged apart from its imports: FastStream 0.7 (repository commit 7c9a125,
# the 0.7 series after 0.7.4), the shared AsyncAPI testcases of its brokers.

from tests.faststream.base.asyncapi.address_template import (
    AddressTemplateTestcase as BaseAddressTemplateTestcase,
)

from .basic import AsyncAPI260Factory


class AddressTemplateTestcase(BaseAddressTemplateTestcase, AsyncAPI260Factory):
    pass
