# Copyright 2023 FastStream authors (https://github.com/ag2ai/faststream)
#
# Licensed under the Apache License, Version 2.0 (see LICENSE beside this file).
#
# From FastStream's tests/marks.py (repository commit 7c9a125): the pydantic marks its AsyncAPI testcases use.

import pytest

from faststream._internal._compat import (
    IS_MACOS,
    IS_WINDOWS,
    PYDANTIC_V2,
)

skip_windows = pytest.mark.skipif(
    IS_WINDOWS,
    reason="does not run on windows",
)

skip_macos = pytest.mark.skipif(
    IS_MACOS,
    reason="does not run on macOS",
)

pydantic_v1 = pytest.mark.skipif(
    PYDANTIC_V2,
    reason="requires PydanticV2",
)

pydantic_v2 = pytest.mark.skipif(
    not PYDANTIC_V2,
    reason="requires PydanticV1",
)

