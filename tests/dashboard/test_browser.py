"""The dashboard in a real browser: Debian's chromium driven by Selenium through chromedriver.

`bus dashboard` runs as its own process (the CLI, as a user starts it) on the
test's schema; the test drives the browser from a thread so its own consumers
keep running on the event loop. BUS_SCREENSHOTS=1 refreshes docs/screenshots/.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

import bus
from tests.dashboard.helpers import TOKEN, dead_letter_one, populate

pytestmark = [pytest.mark.slow, pytest.mark.alone]

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "screenshots"
CHROMIUM = os.environ.get("BUS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = os.environ.get("BUS_CHROMEDRIVER") or shutil.which("chromedriver")
T = TypeVar("T")

if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("chromium and chromedriver are not installed (make installs them)", allow_module_level=True)


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1360,900",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Dashboard:
    def __init__(self, url: str, audit: Path) -> None:
        self.url = url
        self.audit = audit

    def audit_lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.audit.read_text().splitlines()] if self.audit.exists() else []


@pytest.fixture
async def dashboard(bus_client: bus.Bus, tmp_path: Path, driver: Any) -> AsyncIterator[Dashboard]:
    """`bus dashboard --admin --token ...` as a process on the test's schema (the browser's log emptied)."""
    port = free_port()
    audit = tmp_path / "audit.log"
    env = {**os.environ, "BUS_DSN": bus_client.dsn, "BUS_SCHEMA": bus_client.config.schema}
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; it runs beside the loop
        [
            sys.executable,
            "-m",
            "bus",
            "dashboard",
            "--port",
            str(port),
            "--admin",
            "--token",
            TOKEN,
            "--refresh",
            "0.3",
            "--audit-log",
            str(audit),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(300):
                if proc.poll() is not None:
                    raise AssertionError(f"bus dashboard exited: {proc.stdout.read() if proc.stdout else ''}")
                try:
                    if (await client.get(url + "/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("bus dashboard did not answer within 30 s")
        await in_thread(lambda: driver.get_log("browser"))
        yield Dashboard(url, audit)
    finally:
        # Leave the page first: its live stream would retry against the stopped server.
        await in_thread(lambda: driver.get("about:blank"))
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def in_thread(fn: Callable[[], T]) -> T:
    """Selenium blocks: run it off the event loop so the test's consumers keep working."""
    return await asyncio.to_thread(fn)


def severe_console_entries(drv: Any) -> list[dict[str, Any]]:
    return [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]


def text_of(drv: Any, css: str, attribute: str | None = None, timeout: float = 10.0) -> str:
    """An element's text (or attribute) re-found each time: live updates replace the page body."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            el = drv.find_element(By.CSS_SELECTOR, css)
            return str(el.get_attribute(attribute) if attribute else el.text)
        except (StaleElementReferenceException, Exception):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def shoot(drv: Any, name: str, tmp_path: Path) -> None:
    target = SHOTS if os.environ.get("BUS_SCREENSHOTS") == "1" else tmp_path
    target.mkdir(parents=True, exist_ok=True)
    assert drv.save_screenshot(str(target / f"{name}.png"))


def click(drv: Any, css: str, timeout: float = 10.0) -> None:
    """Click an element found afresh until the click lands: a live update may replace it in between."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            drv.find_element(By.CSS_SELECTOR, css).click()
            return
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def click_confirmed(drv: Any, css: str, accept: bool = True) -> str:
    """Click an action button and answer its confirmation dialog; returns the dialog's text."""
    click(drv, css)
    deadline = time.monotonic() + 10
    while True:
        try:
            alert = drv.switch_to.alert
            text = str(alert.text)
            alert.accept() if accept else alert.dismiss()
            return text
        except NoAlertPresentException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


async def test_main_pages_load_without_console_errors(
    bus_client: bus.Bus, dashboard: Dashboard, driver: Any, tmp_path: Path
) -> None:
    await populate(bus_client)
    pages = {
        "topics": ("/", "table#topics", "orders"),
        "groups": ("/groups", "table#groups", "email"),
        "queues": ("/queues", "table#queues", "jobs.dlq"),
        "dead-letters": ("/queues/jobs.dlq", "table#dead-letters", "boom: card declined"),
        # the queue's own page: the dead count the list shows, and those dead letters
        "queue": ("/queues/jobs", "table#dead-letters", "boom: card declined"),
        "claims": ("/claims", "table#es-groups", "mailer"),
        "compaction": ("/compaction", "table#compaction-runs", "no runs recorded"),
        "topic": ("/topics/orders", "table#partitions", "log start"),
        "event-group": ("/eventstore/courses/mailer", "#es-status", "active"),
    }

    def visit_all() -> dict[str, list[dict[str, Any]]]:
        driver.get_log("browser")  # drop whatever came before
        errors = {}
        for name, (path, css, needle) in pages.items():
            driver.get(dashboard.url + path)
            assert needle in text_of(driver, css if name != "compaction" else "main"), name
            # one live update at least: the stream works and leaves the page intact
            before = int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-live-events") or 0)
            deadline = time.monotonic() + 10
            while (
                int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-live-events") or 0) <= before
            ):
                assert time.monotonic() < deadline, f"{name}: no live update"
                time.sleep(0.05)
            assert needle in text_of(driver, css if name != "compaction" else "main"), name
            if name == "queue":
                assert text_of(driver, "#q-dead") == "1"
            if name == "dead-letters":
                click(driver, "table#dead-letters summary")
                time.sleep(0.7)  # a live update or two: the error history stays open
                assert "upstream 503" in text_of(driver, "ol.errors")
            if name in ("topics", "dead-letters", "claims"):
                shoot(driver, name, tmp_path)
            errors[name] = severe_console_entries(driver)
        return errors

    errors = await in_thread(visit_all)
    assert all(not e for e in errors.values()), errors


async def test_lag_falls_visibly_while_a_consumer_drains(
    bus_client: bus.Bus, dashboard: Dashboard, driver: Any, tmp_path: Path
) -> None:
    await bus_client.create_topic("clicks", partitions=4)
    await bus_client.publish_many("clicks", [bus.Outgoing({"n": i}, key=f"u{i % 13}") for i in range(600)])
    # Join first (nothing consumed yet), so the page has a group to show at full lag.
    consumer = bus_client.consumer("analytics", topics=["clicks"], max_poll_records=15, auto_commit=False)
    await consumer.__aenter__()
    start = asyncio.Event()

    async def drain() -> None:
        await start.wait()
        while True:
            batch = await consumer.poll(timeout=0.5)
            if batch:
                await consumer.commit()
            await asyncio.sleep(0.15)

    drainer = asyncio.create_task(drain())
    try:
        await in_thread(lambda: driver.get(dashboard.url + "/groups/analytics"))
        first = int(await in_thread(lambda: text_of(driver, "#total-lag", "data-lag")))
        assert first == 600
        start.set()

        def watch() -> list[int]:
            seen = [first]
            deadline = time.monotonic() + 60
            while seen[-1] > 0 and time.monotonic() < deadline:
                value = int(text_of(driver, "#total-lag", "data-lag"))
                if value != seen[-1]:
                    seen.append(value)
                time.sleep(0.1)
            time.sleep(1.0)  # let the chart draw the last samples
            return seen

        seen = await in_thread(watch)
        assert seen[-1] == 0, seen
        assert len(seen) >= 4, f"the page should show the lag falling step by step, saw {seen}"
        assert all(b <= a for a, b in zip(seen, seen[1:], strict=False)), seen
        points = int(await in_thread(lambda: text_of(driver, "#lag-chart svg", "data-points")))
        assert points >= 4
        await in_thread(lambda: shoot(driver, "group", tmp_path))
        assert not await in_thread(lambda: severe_console_entries(driver))
    finally:
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
        await consumer.__aexit__(None, None, None)


async def test_a_dead_lettered_job_is_replayed_from_the_page_and_consumed(
    bus_client: bus.Bus, dashboard: Dashboard, driver: Any
) -> None:
    await dead_letter_one(bus_client, "payments", {"invoice": 77}, error="gateway timeout")

    def replay() -> str:
        driver.get(dashboard.url + "/queues/payments.dlq")
        assert "gateway timeout" in text_of(driver, "table#dead-letters")
        box = driver.find_element(By.ID, "admin-token")
        box.clear()
        box.send_keys(TOKEN)
        asked = click_confirmed(driver, 'tr[data-offset="0@0"] form.action button')
        assert "Replay payments.dlq/0@0 back into payments" in asked
        return text_of(driver, "#flash")

    assert "replayed 1 message(s)" in await in_thread(replay)
    assert "no dead letters waiting" in await in_thread(lambda: text_of(driver, "#no-dead-letters"))
    async with bus_client.queue_consumer("payments") as q:
        jobs = await q.take(max_messages=5, timeout=5.0)
        assert [j.value() for j in jobs] == [{"invoice": 77}]
        await q.ack(jobs[0])
    async with bus_client.queue_consumer("payments") as q:
        assert await q.take(max_messages=5, timeout=0.3) == []  # consumed: nothing left anywhere
    async with bus_client.queue_consumer("payments.dlq") as q:
        assert await q.take(max_messages=5, timeout=0.3) == []
    assert [(a["action"], a["outcome"]) for a in dashboard.audit_lines()] == [("replay", "ok")]


async def test_an_action_without_the_token_is_refused(
    bus_client: bus.Bus, dashboard: Dashboard, driver: Any
) -> None:
    await dead_letter_one(bus_client, "mail", {"to": "a@example.org"})

    def try_without_token() -> tuple[str, str]:
        driver.get(dashboard.url + "/queues/mail.dlq")
        driver.execute_script("window.sessionStorage.clear()")
        driver.get(dashboard.url + "/queues/mail.dlq")
        assert driver.find_element(By.ID, "admin-token").get_attribute("value") == ""
        # Answering "Cancel" sends nothing at all.
        click_confirmed(driver, "div.actions form.action button", accept=False)
        assert driver.current_url.endswith("/queues/mail.dlq")
        click_confirmed(driver, "div.actions form.action button")  # "Replay all", confirmed, no token
        return text_of(driver, "#problem"), driver.current_url

    problem, url = await in_thread(try_without_token)
    assert "refused" in problem and "token" in problem, problem
    assert url.endswith("/actions/replay")
    async with bus_client.queue_consumer("mail.dlq") as q:
        assert len(await q.take(max_messages=5, timeout=2.0)) == 1  # still dead-lettered
    assert [(a["action"], a["outcome"]) for a in dashboard.audit_lines()] == [("replay", "refused")]
