"""Errors a first service meets name what is wrong: a payload of another shape, a malformed DSN."""

from __future__ import annotations

import msgspec
import pytest

import bus
from bus.errors import ConfigurationError, MessageDecodeError, StorageUnavailableError


class OrderPlaced(msgspec.Struct):
    order_id: int
    amount: int


async def test_value_of_a_payload_of_another_shape_names_the_message_and_the_field(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=2)
    await b.publish("orders", {"order_id": 1, "amount": 5}, partition="1")
    rec = await b.publish("orders", {"order_id": 2, "amount": "five"}, partition="1")
    missing = await b.publish("orders", {"amount": 3}, partition="1")
    ok, wrong, incomplete = await b.read("orders", partition="1")
    assert ok.value(OrderPlaced) == OrderPlaced(1, 5)
    with pytest.raises(MessageDecodeError) as caught:
        wrong.value(OrderPlaced)
    e = caught.value
    assert (e.topic, e.partition, e.offset, e.field) == ("orders", "1", rec.offset, "$.amount")
    assert f"orders/1@{rec.offset}" in str(e) and "OrderPlaced" in str(e) and "$.amount" in str(e)
    assert isinstance(e, bus.BusError) and isinstance(e, msgspec.ValidationError)  # old except clauses hold
    with pytest.raises(MessageDecodeError) as caught:
        incomplete.value(OrderPlaced)
    assert caught.value.missing == "order_id" and caught.value.offset == missing.offset
    assert "'order_id'" in str(caught.value)


@pytest.mark.parametrize(
    "dsn",
    ["postgress://app@localhost/app", "host=localhost dbname=app", "postgresql://app@localhost:54x2/app"],
)
async def test_a_malformed_dsn_is_a_configuration_error_never_retry_it(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        await bus.connect(dsn)
    assert not isinstance(caught.value, StorageUnavailableError)
    assert "retry it" not in str(caught.value) and "DSN" in str(caught.value)
    monkeypatch.setenv("BUS_DSN", dsn)  # from the environment too
    with pytest.raises(ConfigurationError):
        await bus.connect()


async def test_an_unreachable_server_is_still_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StorageUnavailableError):
        await bus.connect("postgresql://app@127.0.0.1:1/app")
