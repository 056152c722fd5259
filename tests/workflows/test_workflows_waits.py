"""Waits of a workflow run: durable sleep, recv and wait_for, without lost wake-ups."""

from __future__ import annotations

import time

import pytest

import bus
from bus.testing import eventually


def now() -> float:
    return time.time()


async def test_a_long_sleep_parks_the_run_and_wakes_within_a_second_of_its_time(b: bus.Bus) -> None:
    @b.workflow("nap")
    async def nap(ctx: bus.WorkflowContext, seconds: float) -> float:
        await ctx.step(now)
        await ctx.sleep(seconds)
        return float(await ctx.step(now))

    run = await b.start_workflow("nap", 3.0, workflow_id="nap-1")

    async def parked() -> bool:
        info = await b.admin.workflow("nap-1")
        return info.status == "waiting" and info.wake_at is not None

    await eventually(parked)
    woke = await run.result(timeout=30)
    info = await b.admin.workflow("nap-1")
    deadline = [s for s in info.steps if s.kind == "deadline"][0]
    wake_at = float(deadline.output or b"0")
    assert 0 <= woke - wake_at < 1.0, f"woke {woke - wake_at:.3f}s after its time"
    assert info.executions == 2  # taken once, parked, taken again by its timer job


@pytest.mark.parametrize("before", [True, False], ids=["sent-before", "sent-after"])
async def test_recv_gets_a_message_sent_before_or_after_it_began(b: bus.Bus, before: bool) -> None:
    @b.workflow("inbox")
    async def inbox(ctx: bus.WorkflowContext) -> object:
        await ctx.set_event("ready", True)
        got = await ctx.recv("approval", timeout=30)
        late = await ctx.recv("approval", timeout=0.3)
        return [got, late]

    if before:
        await b.send("in-1", "approval", {"ok": True})
    run = await b.start_workflow("inbox", workflow_id="in-1")
    assert await b.get_event("in-1", "ready", timeout=30) is True
    if not before:
        await b.send("in-1", "approval", {"ok": True})
    assert await run.result(timeout=30) == [{"ok": True}, None]


@pytest.mark.parametrize("before", [True, False], ids=["published-before", "published-after"])
async def test_wait_for_is_woken_by_a_message_published_before_or_after_the_wait(
    b: bus.Bus, before: bool
) -> None:
    await b.create_topic("shipments", partitions=4)
    await b.publish("shipments", {"order": 1, "note": "before the run"}, key="order-1")

    @b.workflow("ship")
    async def ship(ctx: bus.WorkflowContext) -> object:
        await ctx.recv("go")
        m = await ctx.wait_for("shipments", key="order-1", timeout=30)
        assert m is not None
        none = await ctx.wait_for("shipments", key="order-1", timeout=0.3)
        return [m.value(dict), none]

    run = await b.start_workflow("ship", workflow_id="s-1")
    if before:
        await b.publish("shipments", {"order": 1}, key="order-1")
        await b.publish("shipments", {"order": 2}, key="order-2")
        await b.send("s-1", "go", None)
    else:
        await b.send("s-1", "go", None)

        async def waiting() -> bool:
            return len((await b.admin.workflow("s-1")).steps) >= 2  # recv, then the wait's deadline

        await eventually(waiting)
        await b.publish("shipments", {"order": 2}, key="order-2")
        await b.publish("shipments", {"order": 1}, key="order-1")
    assert await run.result(timeout=30) == [{"order": 1}, None]


async def test_a_short_sleep_waits_in_the_process(b: bus.Bus) -> None:
    @b.workflow("blink")
    async def blink(ctx: bus.WorkflowContext) -> float:
        start = float(await ctx.step(now))
        await ctx.sleep(0.4)
        return float(await ctx.step(now)) - start

    run = await b.start_workflow("blink")
    assert 0.4 <= await run.result(timeout=30) < 5
    assert (await run.status()).executions == 1
