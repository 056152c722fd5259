"""The dashboard's Starlette application: server-rendered pages, an SSE stream per page, admin actions.

Pages render Jinja2 templates; each page's body is also a fragment that
`/live/<page>` streams as server-sent events every `refresh` seconds, which
the page's one script (served from this package) swaps in. Actions are POST
forms: refused unless the app was built with an admin token and the request
carries it (`token` form field or `Authorization: Bearer`), and unless
`confirm=yes` (the page's confirmation dialog sets it). Every action, done or
refused, writes one audit line.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from bus.dashboard import views
from storage.errors import BusError, GroupNotFoundError, TopicNotFoundError, ValidationError

if TYPE_CHECKING:
    from bus.client import Bus

audit_log = logging.getLogger("bus.dashboard.audit")

_PACKAGE = resources.files("bus.dashboard")
# Only the package's own script and styles; no inline script, nothing from elsewhere.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)

_HTML_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class Audit:
    """One JSON line per action attempt: to the `bus.dashboard.audit` logger and, if given, a file."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)

    def write(self, request: Request, action: str, target: str, outcome: str, detail: str = "") -> None:
        """Record who (client address) did what to which target, and how it ended."""
        client = request.client.host if request.client else "-"
        line = json.dumps(
            {
                "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "client": client,
                "action": action,
                "target": target,
                "outcome": outcome,
                "detail": detail,
            },
            sort_keys=False,
        )
        audit_log.warning("%s", line)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(line + "\n")


async def _form(request: Request) -> dict[str, str]:
    """The posted form fields (application/x-www-form-urlencoded: what the pages' forms send)."""
    body = await request.body()
    if len(body) > 65536:
        raise _Refused(413, "refused: the form is too large")
    return dict(parse_qsl(body.decode("utf-8", errors="replace"), keep_blank_values=True))


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def build_app(
    b: Bus,
    *,
    admin_token: str | None = None,
    audit_path: str | Path | None = None,
    refresh: float = 1.0,
    history_seconds: float = 600.0,
) -> Starlette:
    """The dashboard for `b` (see `bus.dashboard.app`)."""
    if admin_token is not None and len(admin_token) < 8:
        raise ValidationError("the admin token must be at least 8 characters (use a long random one)")
    refresh = min(max(float(refresh), 0.1), 60.0)
    history = views.History(seconds=history_seconds, interval=refresh)
    dash = _Dashboard(b, history, Audit(audit_path), admin_token, refresh)

    async def healthz(request: Request) -> Response:
        # Always 200 while the dashboard serves: a liveness probe must not restart a service that is
        # waiting out a database outage; `status` says whether the Bus is "healthy", "degraded" or "failed".
        health = b.health()
        return JSONResponse(
            {
                "ok": True,
                "admin": admin_token is not None,
                "schema": b.config.schema,
                "status": health.status,
                "database_available": health.database_available,
                "unavailable_seconds": health.unavailable_seconds,
                "outages": health.outages,
                "problems": health.problems,
            }
        )

    async def favicon(request: Request) -> Response:
        return RedirectResponse(request.scope.get("root_path", "") + "/static/favicon.svg", status_code=301)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        history.ensure_running(b)
        yield
        await history.stop()

    routes: list[Route | Mount] = [Route(path, dash.full(page)) for path, page in _PAGES]
    routes += [Route("/live" + path, dash.live(page)) for path, page in _PAGES]
    routes += [dash.action(name, run) for name, run in _ACTIONS]
    routes += [
        Route("/healthz", healthz),
        Route("/favicon.ico", favicon),
        Mount("/static", StaticFiles(directory=str(_PACKAGE / "static")), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.history = history
    app.state.audit = dash.audit
    return app


def _environment() -> jinja2.Environment:
    """The templates of the package, autoescaped, with the filters the pages use."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("bus.dashboard", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["ago"] = views.ago
    env.filters["ts"] = lambda v: "-" if v is None else f"{v:%Y-%m-%d %H:%M:%S}"
    env.filters["url"] = lambda v: quote(str(v), safe="")
    return env


# --- pages: (template, context) for a request -------------------------------------------------

Page = Callable[["Bus", "views.History", Request], Awaitable[tuple[str, dict[str, Any]]]]


async def _topics(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "topics.html", await views.topics_page(b, history)


async def _topic(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "topic.html", await views.topic_page(b, request.path_params["name"], history)


async def _groups(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "groups.html", await views.groups_page(b, history)


async def _group(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "group.html", await views.group_page(b, request.path_params["name"], history)


async def _queues(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "queues.html", await views.queues_page(b)


async def _queue(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "queue.html", await views.queue_page(b, request.path_params["name"])


async def _claims(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "claims.html", await views.claims_page(b)


async def _claim_group(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "claim_group.html", await views.claim_group_page(b, request.path_params["name"])


async def _es_group(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    p = request.path_params
    return "es_group.html", await views.es_group_page(b, p["store"], p["name"])


async def _compaction(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    return "compaction.html", await views.compaction_page(b)


async def _workflows(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    from bus.workflows.dashboard import runs_page

    return "workflows.html", await runs_page(b)


async def _workflow(b: Bus, history: views.History, request: Request) -> tuple[str, dict[str, Any]]:
    from bus.workflows.dashboard import run_page

    return "workflow.html", await run_page(b, request.path_params["workflow_id"])


_PAGES: list[tuple[str, Page]] = [
    ("/", _topics),
    ("/topics", _topics),
    ("/topics/{name}", _topic),
    ("/groups", _groups),
    ("/groups/{name}", _group),
    ("/queues", _queues),
    ("/queues/{name}", _queue),
    ("/claims", _claims),
    ("/claims/{name}", _claim_group),
    ("/eventstore/{store}/{name}", _es_group),
    ("/compaction", _compaction),
    ("/workflows", _workflows),
    ("/workflows/{workflow_id:path}", _workflow),
]


# --- actions: (audit target, outcome) for a confirmed, authorized form ------------------------

Action = Callable[["Bus", dict[str, str]], Awaitable[tuple[str, str]]]


async def _replay(b: Bus, form: dict[str, str]) -> tuple[str, str]:
    topic = form.get("topic", "")
    if form.get("partition") or form.get("offset"):
        try:
            offset = int(form.get("offset", ""))
        except ValueError:
            raise ValidationError("offset must be an integer") from None
        n = await views.replay(b, topic, form.get("partition", ""), offset)
        return f"{topic}/{form.get('partition')}@{offset}", f"replayed {n} message(s) from {topic}"
    n = await views.replay(b, topic)
    return f"{topic} (all)", f"replayed {n} message(s) from {topic}"


async def _reset_offsets(b: Bus, form: dict[str, str]) -> tuple[str, str]:
    group, to = form.get("group", ""), form.get("to", "")
    if to not in ("earliest", "latest"):
        raise ValidationError("reset to 'earliest' or 'latest'")
    plan = await b.admin.reset_offsets(group, to=to)
    return f"group {group}", f"reset {len(plan)} partition(s) of {group} to {to}"


async def _claim_group_action(b: Bus, form: dict[str, str]) -> tuple[str, str]:
    group, op = form.get("group", ""), form.get("op", "")
    if op in ("stop", "start"):
        await views.set_claim_group_status(b, group, "stopped" if op == "stop" else "active")
        return f"claims group {group}", f"{op} {group}: done"
    if op in ("earliest", "latest"):
        plan = await b.admin.reset_offsets(group, to=op)
        return f"claims group {group}", f"reset {len(plan)} partition(s) of {group} to {op}"
    raise ValidationError("op must be stop, start, earliest or latest")


async def _es_group_action(b: Bus, form: dict[str, str]) -> tuple[str, str]:
    store_name, group, op = form.get("store", ""), form.get("group", ""), form.get("op", "")
    store = b.event_store(store_name)
    ops = {"stop": store.stop_group, "start": store.start_group, "reset": store.reset_group}
    if op not in ops:
        raise ValidationError("op must be stop, start or reset")
    await ops[op](group)
    return f"event group {store_name}/{group}", f"{op} {store_name}/{group}: done"


_ACTIONS: list[tuple[str, Action]] = [
    ("replay", _replay),
    ("reset-offsets", _reset_offsets),
    ("claim-group", _claim_group_action),
    ("es-group", _es_group_action),
]


class _Dashboard:
    """What every endpoint shares: the Bus, the lag history, the audit, the templates and the token."""

    def __init__(
        self, b: Bus, history: views.History, audit: Audit, admin_token: str | None, refresh: float
    ) -> None:
        self.b = b
        self.history = history
        self.audit = audit
        self.admin_token = admin_token
        self.refresh = refresh
        self.env = _environment()

    def render(
        self, request: Request, template: str, context: dict[str, Any], status: int = 200
    ) -> HTMLResponse:
        """A template with what every page shows (base path, admin mode, refresh, flash messages)."""
        base = request.scope.get("root_path", "")
        path = request.url.path[len(base) :] or "/"
        if path.startswith("/live/"):  # a live fragment's forms return to the page, not the stream
            path = path[len("/live") :]
        html = self.env.get_template(template).render(
            base=base,
            health=self.b.health(),
            admin=self.admin_token is not None,
            refresh=self.refresh,
            path=path,
            message=request.query_params.get("msg", ""),
            error=request.query_params.get("err", ""),
            **context,
        )
        return HTMLResponse(html, status_code=status, headers=_HTML_HEADERS)

    async def gather(self, page: Page, request: Request) -> tuple[str, dict[str, Any], int]:
        """The page's template and context, or the error page (404 for a missing topic or group)."""
        self.history.ensure_running(self.b)
        try:
            template, context = await page(self.b, self.history, request)
            return template, context, 200
        except (TopicNotFoundError, GroupNotFoundError) as exc:
            return "error.html", {"problem": str(exc)}, 404
        except BusError as exc:
            return "error.html", {"problem": str(exc)}, 400

    def full(self, page: Page) -> Callable[[Request], Awaitable[Response]]:
        """The whole page, pointing its script at the page's live stream."""

        async def endpoint(request: Request) -> Response:
            template, context, status = await self.gather(page, request)
            base = request.scope.get("root_path", "")
            live = base + "/live" + request.url.path[len(base) :]
            return self.render(request, "page.html", {"body": template, "live": live, **context}, status)

        return endpoint

    def live(self, page: Page) -> Callable[[Request], Awaitable[Response]]:
        """The page's body as server-sent events, one per `refresh` (`?once=1`: one event, then end)."""

        async def endpoint(request: Request) -> Response:
            once = request.query_params.get("once") == "1"

            async def events() -> AsyncIterator[str]:
                yield f"retry: {int(self.refresh * 2000)}\n\n"
                while True:
                    template, context, _ = await self.gather(page, request)
                    html = bytes(
                        self.render(request, "live.html", {"body": template, **context}).body
                    ).decode()
                    yield "".join(f"data: {line}\n" for line in html.splitlines()) + "\n"
                    if once:
                        return
                    # A closed connection ends this loop: Starlette cancels it (or the next send fails).
                    await asyncio.sleep(self.refresh)

            return StreamingResponse(
                events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        return endpoint

    async def authorize(self, request: Request, action: str) -> None:
        """Refuse unless the dashboard has a token, the request carries it, and the form confirms."""
        form = await _form(request)
        if self.admin_token is None:
            raise _Refused(
                403, "this dashboard is read-only; start it with --admin --token T to allow actions"
            )
        given = form.get("token", "")
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given = header[7:].strip()
        if not given or not hmac.compare_digest(given.encode(), self.admin_token.encode()):
            raise _Refused(403, "refused: the admin token is missing or wrong (enter it in the token field)")
        if form.get("confirm") != "yes":
            raise _Refused(400, f"refused: {action} needs confirmation (confirm=yes)")

    def action(self, name: str, run: Action) -> Route:
        """POST /actions/<name>: check token and confirmation, run, audit, and go back to the page."""

        async def endpoint(request: Request) -> Response:
            base = request.scope.get("root_path", "")
            target, back = "-", "/"
            try:
                form = await _form(request)
                target = form.get("target", "-")
                back = form.get("next", "/")
                if not back.startswith("/") or back.startswith("//"):
                    back = "/"
                await self.authorize(request, name)
                target, done = await run(self.b, form)
            except _Refused as exc:
                self.audit.write(request, name, target, "refused", exc.reason)
                context = {"problem": exc.reason, "body": "error.html", "live": ""}
                return self.render(request, "page.html", context, exc.status)
            except BusError as exc:
                self.audit.write(request, name, target, "failed", str(exc))
                sep = "&" if "?" in back else "?"
                return RedirectResponse(f"{base}{back}{sep}err={quote(str(exc))}", status_code=303)
            self.audit.write(request, name, target, "ok", done)
            sep = "&" if "?" in back else "?"
            return RedirectResponse(f"{base}{back}{sep}msg={quote(done)}", status_code=303)

        return Route(f"/actions/{name}", endpoint, methods=["POST"])
