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


async def test_compensations_run_newest_first_once_when_the_run_fails(b: bus.Bus) -> None:
    done: list[str] = []

    def book(what: str) -> str:
        done.append(f"book {what}")
        return what

    def cancel(what: str) -> None:
        done.append(f"cancel {what}")

    def fail() -> None:
        raise ValueError("no seats")

    @b.workflow("trip")
    async def trip(ctx: bus.WorkflowContext) -> None:
        for what in ("flight", "hotel", "car"):
            await ctx.step(book, what)
            ctx.on_failure(cancel, what)
        await ctx.step(fail)

    run = await b.start_workflow("trip", workflow_id="trip-1")
    with pytest.raises(WorkflowFailedError):
        await run.result(timeout=30)
    assert done == [
        "book flight",
        "book hotel",
        "book car",
        "cancel car",
        "cancel hotel",
        "cancel flight",
    ]
    info = await b.admin.workflow("trip-1")
    assert [s.name for s in info.steps[-3:]] == [f"compensate:{cancel.__qualname__}"] * 3
    # resumed, the failure replays from its records: no booking and no compensation runs twice
    assert await b.admin.resume_workflow("trip-1")
    with pytest.raises(WorkflowFailedError):
        await run.result(timeout=30)
    assert done.count("cancel car") == 2  # resume retries the failed step, so the failure is new
    assert done.count("book car") == 1


async def test_children_fan_out_and_in_with_a_failing_child_started_again(b: bus.Bus) -> None:
    failed: set[int] = set()

    def pack_item(item: int) -> int:
        if item == 2 and item not in failed:
            failed.add(item)
            raise RuntimeError("box jammed")
        return item * 100

    @b.workflow("pack")
    async def pack(ctx: bus.WorkflowContext, item: int) -> int:
        return int(await ctx.step(pack_item, item))

    @b.workflow("order")
    async def order(ctx: bus.WorkflowContext, items: list[int]) -> list[int]:
        return list(
            await asyncio.gather(*(ctx.child("pack", i, retry=bus.Retry(max_attempts=2)) for i in items))
        )

    run = await b.start_workflow("order", [1, 2, 3], workflow_id="o-1")
    assert await run.result(timeout=30) == [100, 200, 300]
    runs = {w.workflow_id: w for w in await b.admin.workflows(name="pack")}
    assert {k: w.status for k, w in runs.items()} == {
        "o-1/1": "succeeded",
        "o-1/2": "failed",
        "o-1/2.2": "succeeded",
        "o-1/3": "succeeded",
    }
    assert all(w.parent_id == "o-1" for w in runs.values())


async def test_a_changed_workflow_raises_version_error_and_a_version_keeps_old_runs(b: bus.Bus) -> None:
    def a() -> str:
        return "a"

    def other() -> str:
        return "other"

    @b.workflow("flow")
    async def flow(ctx: bus.WorkflowContext) -> str:
        await ctx.step(a)
        await ctx.sleep(2.5)  # parks the run: the code changes before it resumes
        return "old"

    run = await b.start_workflow("flow", workflow_id="f-1")
    await eventually(lambda: _status_is(b, "f-1", "waiting"))

    @b.workflow("flow")
    async def changed(ctx: bus.WorkflowContext) -> str:
        await ctx.step(other)
        return "new"

    with pytest.raises(WorkflowVersionError):
        await run.result(timeout=30)

    @b.workflow("flow2", version="1")
    async def flow2_v1(ctx: bus.WorkflowContext) -> str:
        await ctx.step(a)
        await ctx.sleep(2.5)
        return "v1"

    old = await b.start_workflow("flow2", workflow_id="f-2")
    await eventually(lambda: _status_is(b, "f-2", "waiting"))

    @b.workflow("flow2", version="2")
    async def flow2_v2(ctx: bus.WorkflowContext) -> str:
        await ctx.step(other)
        return "v2"

    new = await b.start_workflow("flow2", workflow_id="f-3")
    assert await new.result(timeout=30) == "v2"
    assert await old.result(timeout=30) == "v1"


async def _status_is(b: bus.Bus, wid: str, status: str) -> bool:
    return (await b.admin.workflow(wid)).status == status


async def test_cancel_resume_and_fork(b: bus.Bus) -> None:
    calls: list[str] = []

    def first() -> str:
        calls.append("first")
        return "1"

    def last(go: Any) -> str:
        calls.append("last")
        return f"done {go}"

    @b.workflow("gate")
    async def gate(ctx: bus.WorkflowContext) -> str:
        await ctx.step(first)
        go = await ctx.recv("go")
        return str(await ctx.step(last, go))

    run = await b.start_workflow("gate", workflow_id="g-1")

    async def first_recorded() -> bool:
        return len((await b.admin.workflow("g-1")).steps) == 1

    await eventually(first_recorded)
    assert await b.admin.cancel_workflow("g-1")
    with pytest.raises(bus.errors.WorkflowCancelledError):
        await run.result(timeout=10)
    assert not await b.admin.cancel_workflow("g-1")  # finished already
    await b.send("g-1", "go", 1)
    assert (await b.admin.workflow("g-1")).status == "cancelled"
    assert await b.admin.resume_workflow("g-1")
    assert await run.result(timeout=30) == "done 1"
    assert calls == ["first", "last"]
    # a fork from step 3 keeps steps 1 and 2 (first, recv) and runs `last` again
    fork = await b.admin.fork_workflow("g-1", from_step=3, new_id="g-2")
    assert await fork.result(timeout=30) == "done 1"
    assert calls == ["first", "last", "last"]
    # a fork from step 2 waits for a message of its own
    fork2 = await b.admin.fork_workflow("g-1", from_step=2, new_id="g-3")
    await b.send("g-3", "go", 2)
    assert await fork2.result(timeout=30) == "done 2"
    assert calls == ["first", "last", "last", "last"]


async def test_bad_input_raises_a_typed_error_and_writes_nothing(b: bus.Bus) -> None:
    @b.workflow("noop")
    async def noop(ctx: bus.WorkflowContext, value: object) -> object:
        return value

    with pytest.raises(bus.ValidationError):
        await b.start_workflow("noop", object(), workflow_id="bad-args")  # not JSON-encodable
    with pytest.raises(bus.ValidationError):
        await b.start_workflow("noop", 1, workflow_id="x" * 201)
    with pytest.raises(bus.ValidationError):
        await b.start_workflow("no such name!", 1)
    with pytest.raises(bus.ValidationError):
        b.workflow("noop", version="")(noop)
    with pytest.raises(bus.errors.WorkflowNotFoundError):
        await b.workflow_result("never-started", timeout=1)
    with pytest.raises(bus.errors.WorkflowNotFoundError):
        await b.admin.cancel_workflow("never-started")
    with pytest.raises(bus.ValidationError):
        await b.admin.workflows(status="sleeping")
    assert await b.admin.workflows() == []
    run = await b.start_workflow("noop", {"a": 1}, workflow_id="good")
    assert await run.result(timeout=30) == {"a": 1}
    with pytest.raises(bus.ValidationError):  # the id is a run of another workflow
        await b.start_workflow("trip", workflow_id="good")
    # a workflow no process registered: its run waits, and a result times out
    await b.start_workflow("elsewhere", workflow_id="waits")
    with pytest.raises(TimeoutError):
        await b.workflow_result("waits", timeout=0.3)
    assert (await b.admin.workflow("waits")).status == "pending"


async def test_concurrent_starts_of_one_run_never_need_more_connections_than_the_pool_has(
    dsn: str, schema: str
) -> None:
    # Each start inserts the run and publishes its job in one transaction on a pool connection; the
    # starts that lose the race wait for the winner's insert on theirs. Had the winner still to look
    # the job's partition up on the pool, it would wait for a connection the losers hold: for ever.
    async with bus.connect(dsn, schema=schema, pool_min_size=1, pool_max_size=4, cleaner_interval=0) as b:

        @b.workflow("tiny")
        async def tiny(ctx: bus.WorkflowContext) -> int:
            return 1

        starts = [b.start_workflow("tiny", workflow_id="only-one") for _ in range(12)]
        handles = await asyncio.wait_for(asyncio.gather(*starts), timeout=60)
        assert {h.workflow_id for h in handles} == {"only-one"}
        assert await handles[0].result(timeout=60) == 1
        assert [w.workflow_id for w in await b.admin.workflows(name="tiny")] == ["only-one"]
