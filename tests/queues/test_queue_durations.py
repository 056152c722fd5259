"""Queue durations take a number of seconds or a timedelta, and refuse bools, NaN and infinity."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

import bus


async def test_timedelta_durations_and_refused_numbers(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", {"n": 1}, key="k")
    q = bus.QueueConsumer(b, "jobs", visibility_timeout=timedelta(seconds=20))
    assert q.visibility_timeout == 20.0
    async with q:
        [msg] = await q.take(1, timeout=timedelta(seconds=5))
        with pytest.raises(bus.ValidationError, match="delay must be a number of seconds >= 0"):
            await q.nack(msg, delay=math.nan)
        with pytest.raises(bus.ValidationError, match="timeout must be a timedelta or a number of seconds"):
            await q.take(1, timeout=True)
        await q.nack(msg, delay=timedelta(0))
        [again] = await q.take(1, timeout=timedelta(seconds=5))
        assert again.offset == msg.offset and again.attempt == 2
        await q.ack(again)
    for bad in (math.inf, 0, True):
        with pytest.raises(bus.ValidationError, match="visibility_timeout"):
            bus.QueueConsumer(b, "jobs", visibility_timeout=bad)
