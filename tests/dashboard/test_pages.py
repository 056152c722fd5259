"""The dashboard's pages, live stream and actions, through its ASGI app (no browser)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import bus
import bus.dashboard
from bus import claims as bus_claims
from bus.testing import wait_consumed
from tests.dashboard.helpers import TOKEN, dead_letter_one, populate


async def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash")


@pytest.fixture
async def populated(bus_client: bus.Bus) -> bus.Bus:
    await populate(bus_client)
    return bus_client


@pytest.fixture
async def admin_client(populated: bus.Bus, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = bus.dashboard.app(populated, admin_token=TOKEN, audit_log=tmp_path / "audit.log", refresh=0.2)
    async with await client_for(app) as client:
        yield client
    await app.state.history.stop()


def audit_lines(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_every_page_shows_its_data(populated: bus.Bus) -> None:
    app = bus.dashboard.app(populated)
    lag = (await populated.admin.describe_group("email")).total_lag
    assert lag > 0
    async with await client_for(app) as client:
        pages = {
            "/": ["orders", "jobs.dlq", "queue"],
            "/topics/orders": ["log start", "end offset"],
            "/groups": ["email", "billing"],
            "/groups/email": ["generation", f'data-lag="{lag}"', "lag-chart", "<svg"],
            "/queues": ["jobs", "jobs.dlq", "dead letters"],
            "/queues/jobs.dlq": ["boom: card declined", "{&#34;job&#34;:1}", "jobs"],
            "/claims": ['data-group="billing"', "courses", "mailer", "certificates", "KeyError", "failed"],
            "/claims/billing": ["orders", "lease expires"],
            "/eventstore/courses/mailer": ["active", "max attempts"],
            "/compaction": ["Compaction runs"],
        }
        for path, needles in pages.items():
            r = await client.get(path)
            assert r.status_code == 200, (path, r.text[:500])
            assert "default-src 'self'" in r.headers["content-security-policy"]
            for needle in needles:
                assert needle in r.text, (path, needle)
            # read-only: no action forms
            assert "/actions/" not in r.text
        claims = (await client.get("/claims")).text
        assert 'data-group="email"' not in claims  # a consumer group whose member left is not a claims group
        assert "attempt 1: upstream 503" in (await client.get("/queues/jobs.dlq")).text
        missing = await client.get("/groups/nope")
        assert missing.status_code == 404 and "does not exist" in missing.text
        assert (await client.get("/static/dashboard.js")).status_code == 200
    await app.state.history.stop()


async def test_live_stream_sends_the_page_body(populated: bus.Bus) -> None:
    app = bus.dashboard.app(populated)
    async with await client_for(app) as client:
        r = await client.get("/live/groups/email", params={"once": "1"})
        assert r.headers["content-type"].startswith("text/event-stream")
        data = "\n".join(line[6:] for line in r.text.splitlines() if line.startswith("data: "))
        assert 'id="total-lag"' in data and "<html" not in data
    await app.state.history.stop()


async def test_read_only_dashboard_refuses_actions(populated: bus.Bus, tmp_path: Path) -> None:
    app = bus.dashboard.app(populated, audit_log=tmp_path / "audit.log")
    async with await client_for(app) as client:
        r = await client.post(
            "/actions/replay",
            data={"topic": "jobs.dlq", "token": TOKEN, "confirm": "yes", "target": "jobs.dlq"},
        )
        assert r.status_code == 403 and "read-only" in r.text
    assert [(a["action"], a["outcome"]) for a in audit_lines(tmp_path)] == [("replay", "refused")]
    async with populated.queue_consumer("jobs.dlq") as q:
        assert len(await q.take(max_messages=10, timeout=0.5)) == 1  # still dead-lettered


async def test_actions_need_the_token_and_a_confirmation(
    admin_client: httpx.AsyncClient, tmp_path: Path
) -> None:
    page = (await admin_client.get("/queues/jobs.dlq")).text
    assert 'action="/actions/replay"' in page and "data-confirm" in page
    form = {"topic": "jobs.dlq", "target": "jobs.dlq (all)", "next": "/queues/jobs.dlq"}
    for extra, status in (({}, 403), ({"token": "wrong-token-x"}, 403), ({"token": TOKEN}, 400)):
        r = await admin_client.post("/actions/replay", data={**form, **extra})
        assert r.status_code == status, r.text
        assert "refused" in r.text
    r = await admin_client.post(
        "/actions/replay", data=form, headers={"Authorization": f"Bearer {TOKEN}"}
    )  # confirmation still missing
    assert r.status_code == 400
    outcomes = [a["outcome"] for a in audit_lines(tmp_path)]
    assert outcomes == ["refused"] * 4
    assert "boom: card declined" in (await admin_client.get("/queues/jobs.dlq")).text


async def test_replay_one_puts_the_job_back_into_its_queue(
    populated: bus.Bus, admin_client: httpx.AsyncClient, tmp_path: Path
) -> None:
    r = await admin_client.post(
        "/actions/replay",
        data={
            "topic": "jobs.dlq",
            "partition": "0",
            "offset": "0",
            "token": TOKEN,
            "confirm": "yes",
            "target": "jobs.dlq/0@0",
            "next": "/queues/jobs.dlq",
        },
    )
    assert r.status_code == 303 and "replayed%201%20message" in r.headers["location"]
    after = (await admin_client.get(r.headers["location"])).text
    assert "replayed 1 message(s)" in after and 'id="no-dead-letters"' in after
    async with populated.queue_consumer("jobs") as q:
        jobs = await q.take(max_messages=10, timeout=5.0)
        assert [j.value() for j in jobs] == [{"job": 1}]
        assert jobs[0].key == "k1" and jobs[0].headers["replayed_from"] == "jobs.dlq/0@0"
        assert not any(k.startswith("dead_letter.") for k in jobs[0].headers)
        await q.ack(jobs[0])
    (line,) = audit_lines(tmp_path)
    assert (line["action"], line["target"], line["outcome"]) == ("replay", "jobs.dlq/0@0", "ok")
    # replaying it again finds nothing: it is no longer there
    r = await admin_client.post(
        "/actions/replay",
        data={"topic": "jobs.dlq", "partition": "0", "offset": "0", "token": TOKEN, "confirm": "yes"},
    )
    assert r.status_code == 303 and "err=" in r.headers["location"]


async def test_replay_all(populated: bus.Bus, admin_client: httpx.AsyncClient) -> None:
    await dead_letter_one(populated, "jobs", {"job": 2}, error="timeout")
    r = await admin_client.post(
        "/actions/replay", data={"topic": "jobs.dlq", "token": TOKEN, "confirm": "yes"}
    )
    assert r.status_code == 303 and "replayed%202%20message" in r.headers["location"]
    async with populated.queue_consumer("jobs") as q:
        jobs = await q.take(max_messages=10, timeout=5.0)
        assert sorted(j.value()["job"] for j in jobs) == [1, 2]


async def test_group_actions(
    populated: bus.Bus, admin_client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Bus re-reads a claims group's status at most every FULL_SYNC_INTERVAL: here at every claim.
    monkeypatch.setattr(bus_claims, "FULL_SYNC_INTERVAL", 0.0)
    auth = {"token": TOKEN, "confirm": "yes"}
    r = await admin_client.post("/actions/claim-group", data={"group": "billing", "op": "stop", **auth})
    assert r.status_code == 303
    with pytest.raises(bus.GroupStoppedError):
        await populated.claim("billing", topic="orders", worker_id="w-2")
    await admin_client.post("/actions/claim-group", data={"group": "billing", "op": "start", **auth})
    assert await populated.claim("billing", topic="orders", worker_id="w-2") is not None

    store = populated.event_store("courses")
    await admin_client.post(
        "/actions/es-group", data={"store": "courses", "group": "mailer", "op": "stop", **auth}
    )
    assert await store.group_status("mailer") == "stopped"
    await admin_client.post(
        "/actions/es-group", data={"store": "courses", "group": "mailer", "op": "start", **auth}
    )
    assert await store.group_status("mailer") == "active"

    r = await admin_client.post("/actions/reset-offsets", data={"group": "email", "to": "earliest", **auth})
    assert r.status_code == 303
    d = await populated.admin.describe_group("email")
    assert d.total_lag == 30
    assert [a["outcome"] for a in audit_lines(tmp_path)] == ["ok"] * 5


async def test_wait_consumed_and_lag_history(bus_client: bus.Bus) -> None:
    await bus_client.create_topic("t", partitions=2)
    for i in range(20):
        await bus_client.publish("t", {"i": i})
    seen: list[int] = []

    async def handler(m: bus.Message) -> None:
        seen.append(m.value()["i"])

    app = bus.dashboard.app(bus_client, refresh=0.1)
    history = app.state.history
    await history.sample(bus_client)
    sub = await bus_client.subscribe("g", handler, topics=["t"])
    d = await wait_consumed(bus_client, "g")
    await history.sample(bus_client)
    await sub.stop()
    assert sorted(seen) == list(range(20)) and d.total_lag == 0
    assert [v for _, v in history.lag["g"]][-1] == 0
    assert history.rate("t") is not None


def test_cli_refuses_admin_without_token() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bus", "dashboard", "--admin"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--token" in proc.stdout


async def test_mounted_in_a_service_under_a_prefix(populated: bus.Bus) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    dash = bus.dashboard.app(populated, admin_token=TOKEN)
    service = Starlette(routes=[Mount("/ops/bus", app=dash)])
    async with await client_for(service) as client:
        page = (await client.get("/ops/bus/queues/jobs.dlq")).text
        assert (
            'src="/ops/bus/static/dashboard.js"' in page
            and 'data-live="/ops/bus/live/queues/jobs.dlq"' in page
        )
        assert 'action="/ops/bus/actions/replay"' in page and 'href="/ops/bus/groups"' in page
        r = await client.post(
            "/ops/bus/actions/replay",
            data={"topic": "jobs.dlq", "token": TOKEN, "confirm": "yes", "next": "/queues/jobs.dlq"},
        )
        assert r.status_code == 303 and r.headers["location"].startswith("/ops/bus/queues/jobs.dlq?msg=")
        assert (await client.get("/ops/bus/static/dashboard.js")).status_code == 200
    await dash.state.history.stop()


async def test_compaction_runs_page(bus_client: bus.Bus) -> None:
    from storage.compaction import sql as compaction_sql

    run = await bus_client.pool.fetchrow(compaction_sql.INSERT_RUN, "/tmp/archive-x", None)
    await bus_client.pool.execute(compaction_sql.FINISH_RUN, run["id"])
    open_run = await bus_client.pool.fetchrow(compaction_sql.INSERT_RUN, "/tmp/archive-y", ["orders"])
    app = bus.dashboard.app(bus_client)
    async with await client_for(app) as client:
        page = (await client.get("/compaction")).text
    assert "/tmp/archive-x" in page and "/tmp/archive-y" in page and "status-done" in page
    assert page.index(f"<td>{open_run['id']}</td>") < page.index(f"<td>{run['id']}</td>")  # newest first
    await app.state.history.stop()


async def test_a_queue_page_shows_the_dead_count_of_the_queue_list_and_those_dead_letters(
    populated: bus.Bus,
) -> None:
    app = bus.dashboard.app(populated)
    depth = await populated.admin.queue_depth("jobs")
    assert depth.dead == 1
    async with await client_for(app) as client:
        listing = (await client.get("/queues")).text
        page = (await client.get("/queues/jobs")).text
    await app.state.history.stop()
    assert '<dd id="q-dead">1</dd>' in page
    assert "no dead letters waiting" not in page  # the list says dead = 1: so does the queue's page
    assert "Dead letters of jobs waiting in jobs.dlq" in page and "boom: card declined" in page
    assert '<td class="num dead"><a href="/queues/jobs.dlq">1</a></td>' in listing


async def test_the_lag_chart_of_a_dashboard_started_later_shows_the_samples_kept_before(
    populated: bus.Bus,
) -> None:
    from bus.dashboard import views

    earlier = views.History(interval=0.2)
    await earlier.sample(populated)  # a dashboard that ran before keeps its samples in the database
    kept = await populated.pool.fetch("SELECT group_name, lag FROM lag_samples")
    lag = (await populated.admin.describe_group("email")).total_lag
    assert ("email", lag) in [(r["group_name"], r["lag"]) for r in kept]
    later = views.History(interval=0.2)  # a new process: nothing sampled in memory yet
    points = await later.lag_points(populated, "email")
    assert points and points[-1][1] == lag
    app = bus.dashboard.app(populated)
    async with await client_for(app) as client:
        page = (await client.get("/groups/email")).text
    await app.state.history.stop()
    points_drawn = int(page.split('data-points="', 1)[1].split('"', 1)[0])
    assert points_drawn >= 2  # the kept sample and the value read for the page
