"""The group protocol's version: the leader writes, with each assignment, the lowest version
any live member speaks, so a group mixing releases runs on what every member understands."""

from __future__ import annotations

import asyncio
import time

import pytest

import bus
from bus.testing import FAST
from storage import membership


async def _protocol_of_stable_generation(b: bus.Bus, group: str, members: int) -> int | None:
    """The protocol once the group is stable with `members` members that all hold an assignment."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        d = await b.admin.describe_group(group)
        if d.state == "stable" and len(d.members) == members and all(m.partitions for m in d.members):
            return await membership.current_protocol(b.pool, group)
        await asyncio.sleep(0.05)
    raise AssertionError(f"group {group} did not become stable with {members} members: {d}")


def test_a_group_runs_on_the_lowest_protocol_and_unknown_counts_as_1() -> None:
    assert membership.group_protocol([3, 2, 3]) == 2
    assert membership.group_protocol([3, None]) == 1  # a member of release 0.1.0 records none
    assert membership.group_protocol([]) == membership.PROTOCOL


async def test_a_member_speaking_a_lower_protocol_lowers_the_group_until_it_leaves(
    connect: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    newer = await connect(**FAST)
    await newer.create_topic("orders", partitions=4)
    monkeypatch.setattr(membership, "PROTOCOL", 2)  # what a later release will speak
    async with newer.consumer("g", topics=["orders"]):
        assert await _protocol_of_stable_generation(newer, "g", 1) == 2
        monkeypatch.setattr(membership, "PROTOCOL", 1)  # a member of this release joins
        older = await connect(**FAST)
        async with older.consumer("g", topics=["orders"]):
            assert await _protocol_of_stable_generation(newer, "g", 2) == 1
        assert await _protocol_of_stable_generation(newer, "g", 1) == 2
