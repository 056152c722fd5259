import msgspec
import pytest

import bus
from tests.conftest import plan_modes


class Order(msgspec.Struct):
    id: int
    customer: str


async def test_publish_and_read_back_in_order(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=3)
    recs = [await b.publish("orders", Order(i, "c"), partition="1") for i in range(5)]
    assert [r.offset for r in recs] == [0, 1, 2, 3, 4]
    msgs = await b.read("orders", partition="1")
    assert [m.offset for m in msgs] == [0, 1, 2, 3, 4]
    assert msgs[2].value(Order) == Order(2, "c")


async def test_publish_many_is_atomic_and_ordered(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=2)
    recs = await b.publish_many("t", [bus.Outgoing(b"x%d" % i, partition=str(i % 2)) for i in range(10)])
    assert [(r.partition, r.offset) for r in recs] == [(str(i % 2), i // 2) for i in range(10)]


async def test_read_runs_on_a_connection_with_generic_plans(
    b: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the default plan_cache_mode PostgreSQL re-plans the read of the log on every call
    # once `messages` is large; `read` runs on a connection the Lender lends (generic plans).
    from storage import messages as log_sql

    await b.create_topic("t", partitions=1)
    await b.publish("t", b"x")
    modes = plan_modes(monkeypatch, log_sql, "read")
    assert [m.offset for m in await b.read("t", partition=0, offset=0)] == [0]
    assert modes == ["force_generic_plan"]
