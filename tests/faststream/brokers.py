"""The BusBroker the FastStream tests open: on the test's schema, with the FAST timings."""

from __future__ import annotations

from typing import Any

from bus.faststream import BusBroker
from bus.testing import FAST


def fast_broker(dsn: str, schema: str, **kw: Any) -> BusBroker:
    """A BusBroker on `schema` of `dsn` whose groups form and rebalance in a fraction of a second."""
    return BusBroker(dsn, schema=schema, **FAST, **kw)
