"""A member's id is known once it has started (before its partitions come)."""

from __future__ import annotations

import bus


async def test_member_id_is_known_once_the_consumer_block_is_entered(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=1)
    async with b.consumer("email", topics=["orders"]) as c:
        assert c.member_id is not None
        members = (await b.admin.describe_group("email")).members
        assert [m.member_id for m in members] == [c.member_id]
    sub = await b.subscribe("billing", lambda m: None, topics=["orders"])  # type: ignore[arg-type,return-value]
    try:
        assert sub.member_id is not None
    finally:
        await sub.stop()
