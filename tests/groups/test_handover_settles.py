"""The leader looks whether a handover is over soon after it starts, backing off while it goes on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import bus
from actors import rebalancer
from bus.testing import eventually


async def test_the_leader_looks_again_soon_after_a_rebalance_that_moved_partitions(
    connect: Any, fast: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # rebalance_delay 0.5 s: the leader's periodic check runs every 0.25 s. After a rebalance that
    # moved partitions it looks again after HANDOVER_CHECK, then HANDOVER_GROWTH times as late each
    # time the handover is still going on (here the previous owner's on_revoke holds it up), up to
    # the periodic interval; once every moved partition is taken over the group reads stable.
    looks: list[float] = []
    real = rebalancer.Rebalancer._look_again

    def recording(self: rebalancer.Rebalancer, delay: float) -> None:
        looks.append(delay)
        real(self, delay)

    monkeypatch.setattr(rebalancer.Rebalancer, "_look_again", recording)
    timings = {**fast, "rebalance_delay": 0.5}
    b = await connect(**timings)
    await b.create_topic("t", partitions=4)

    async def handler(m: bus.Message) -> None:
        return None

    async def slow_revoke(partitions: Any) -> None:
        await asyncio.sleep(1.5)  # long enough for the looks to reach the periodic interval

    first = await b.subscribe("g", handler, topics=["t"], on_revoke=slow_revoke)

    async def stable(members: int) -> bool:
        d = await b.admin.describe_group("g")
        return d.state == "stable" and len(d.members) == members and all(m.partitions for m in d.members)

    await eventually(lambda: stable(1))
    looks.clear()
    second = await b.subscribe("g", handler, topics=["t"])
    await eventually(lambda: stable(2))
    handover = looks[looks.index(rebalancer.HANDOVER_CHECK) :]
    growth = rebalancer.HANDOVER_GROWTH
    assert handover[:4] == pytest.approx([0.05, 0.05, 0.05 * growth, 0.05 * growth**2]), looks
    assert max(handover) == 0.25, looks  # never later than the periodic check
    await second.stop()
    await first.stop()
