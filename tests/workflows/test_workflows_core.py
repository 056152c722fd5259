"""Durable workflows in one process: steps, transactions, replay, results and errors."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

import bus
from bus.errors import StepFailedError, WorkflowFailedError, WorkflowVersionError
from bus.testing import eventually


class Order(msgspec.Struct):
    id: int
    amount: float


async def test_three_step_workflow_returns_its_result_and_records_each_step(b: bus.Bus) -> None:
    calls: list[str] = []

    async def charge(order: Order) -> dict[str, Any]:
        calls.append("charge")
        return {"card": f"c{order.id}", "amount": order.amount}

    def reserve(order: Order) -> int:
        calls.append("reserve")
        return order.id * 10

    @b.workflow("checkout")
    async def checkout(ctx: bus.WorkflowContext, order: Order) -> dict[str, Any]:
        card = await ctx.step(charge, order)
        slot = await ctx.step(reserve, order)
        async with ctx.transaction() as tx:
            await tx.connection.execute("SELECT 1")
        return {"card": card["card"], "slot": slot}

    run = await b.start_workflow("checkout", Order(7, 9.5), workflow_id="order-7")
    assert await run.result(timeout=30) == {"card": "c7", "slot": 70}
    assert calls == ["charge", "reserve"]
    info = await b.admin.workflow("order-7")
    assert info.status == "succeeded"
    assert [(s.seq, s.kind) for s in info.steps] == [(1, "step"), (2, "step"), (3, "transaction")]
    # the same id again is the same run: nothing runs again
    again = await b.start_workflow("checkout", Order(7, 9.5), workflow_id="order-7")
    assert await again.result(timeout=5) == {"card": "c7", "slot": 70}
    assert calls == ["charge", "reserve"]


async def test_failed_step_is_retried_then_recorded_and_the_run_fails(b: bus.Bus) -> None:
    attempts = []

    def flaky() -> str:
        attempts.append(1)
        raise RuntimeError("card declined")

    @b.workflow("pay")
    async def pay(ctx: bus.WorkflowContext) -> str:
        return str(await ctx.step(flaky, retry=bus.Retry(max_attempts=3, backoff=0.01)))

    run = await b.start_workflow("pay", workflow_id="p1")
    with pytest.raises(WorkflowFailedError) as err:
        await run.result(timeout=30)
    assert err.value.error_type == "StepFailedError"
    assert "card declined" in (err.value.error or "")
    assert len(attempts) == 3
    info = await b.admin.workflow("p1")
    assert info.steps[0].attempts == 3 and info.steps[0].error is not None
    assert StepFailedError.__name__ == info.error_type
