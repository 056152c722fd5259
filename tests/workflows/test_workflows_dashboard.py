"""The dashboard lists workflow runs and shows one run's steps as a timeline."""

from __future__ import annotations

import re
from typing import Any

import httpx

import bus
import bus.dashboard


def check_address(address: str) -> bool:
    return bool(address)


async def test_the_runs_page_and_a_runs_timeline(b: bus.Bus) -> None:
    @b.workflow("signup")
    async def signup(ctx: bus.WorkflowContext, email: str) -> str:
        await ctx.step(check_address, email)
        async with ctx.transaction(name="store-user") as tx:
            await tx.connection.execute("SELECT 1")
        await ctx.sleep(0.05)
        return "ok"

    await (await b.start_workflow("signup", "a@example.com", workflow_id="signup/a@example.com")).result(
        timeout=30
    )
    app: Any = bus.dashboard.app(b)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash") as client:
        runs = await client.get("/workflows")
        assert runs.status_code == 200
        assert 'data-workflow="signup/a@example.com"' in runs.text and "succeeded" in runs.text
        page = await client.get("/workflows/signup%2Fa%40example.com")
        assert page.status_code == 200, page.text
        rows = re.findall(
            r'<tr data-seq="(\d+)">\s*<td class="num">\d+</td><td>(\w+)</td><td>([^<]+)</td>', page.text
        )
        assert rows == [
            ("1", "step", "check_address"),
            ("2", "transaction", "store-user"),
            ("3", "deadline", "sleep"),
        ]
        widths = [float(w) for w in re.findall(r"width: ([\d.]+)%", page.text)]
        assert len(widths) == 3 and all(0 < w <= 100 for w in widths)
        missing = await client.get("/workflows/nope")
        assert missing.status_code == 404 or "no workflow run" in missing.text
    await app.state.history.stop()
