"""A web dashboard for the bus: topics, consumer groups, queues, claims, event-store groups, compaction runs.

    bus dashboard --host 127.0.0.1 --port 8765                 # read-only
    bus dashboard --admin --token "$(openssl rand -hex 16)"    # with actions

or mounted in a service of your own (any ASGI server):

    from starlette.applications import Starlette
    from starlette.routing import Mount
    import bus.dashboard

    service = Starlette(routes=[Mount("/bus", app=bus.dashboard.app(b))])

Needs the `dashboard` extra (`pip install pgactorbus[dashboard]`: Starlette,
Jinja2, uvicorn). Pages are rendered on the server and refresh themselves over
server-sent events; the one script and stylesheet are served from this
package, nothing is fetched from elsewhere. Read-only unless built with an
admin token: replaying dead letters, resetting offsets, and stopping, starting
or resetting claims and event-store groups then need that token and a
confirmation, and each attempt writes an audit line.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from starlette.applications import Starlette

    from bus.client import Bus

__all__ = ["app", "serve"]


def app(
    b: Bus,
    *,
    admin_token: str | None = None,
    audit_log: str | Path | None = None,
    refresh: float = 1.0,
    history_seconds: float = 600.0,
) -> Starlette:
    """The dashboard for the connected Bus `b` as an ASGI (Starlette) app.

    `admin_token`: allow actions to requests carrying this token (at least 8
    characters); None (the default) is read-only. `audit_log`: a file that
    gets one JSON line per action attempt (they always go to the
    `bus.dashboard.audit` logger). `refresh`: seconds between live updates
    and lag samples; `history_seconds`: how far back the lag charts reach.
    """
    from bus.dashboard.web import build_app

    return build_app(
        b, admin_token=admin_token, audit_path=audit_log, refresh=refresh, history_seconds=history_seconds
    )


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (what `bus dashboard` binds to unless told otherwise)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    admin_token: str | None = None,
    audit_log: str | Path | None = None,
    refresh: float = 1.0,
    dsn: str | None = None,
    **config: Any,
) -> None:
    """Connect (like `bus.connect(dsn, **config)`) and serve the dashboard with uvicorn until interrupted."""
    import uvicorn

    import bus

    config.setdefault("cleaner_interval", 0)  # looking must not also clean: the services' own buses do that
    async with bus.connect(dsn, **config) as b:
        server = uvicorn.Server(
            uvicorn.Config(
                app(b, admin_token=admin_token, audit_log=audit_log, refresh=refresh),
                host=host,
                port=port,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=2,
            )
        )
        await server.serve()


def command(
    console: Console,
    *,
    host: str,
    port: int,
    admin: bool,
    token: str | None,
    audit_log: str | None,
    refresh: float,
) -> int:
    """`bus dashboard`: check the options, then serve until Ctrl-C; returns the exit code."""
    import asyncio

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        console.print("[red]error:[/red] the dashboard needs its extra: pip install 'pgactorbus[dashboard]'")
        return 2
    if admin and not token:
        console.print(
            "[red]error:[/red] --admin needs --token T (or BUS_DASHBOARD_TOKEN): actions are refused without it"
        )
        return 2
    if token and not admin:
        console.print("note: --token without --admin is ignored; the dashboard is read-only")
        token = None
    if token is not None and len(token) < 8:
        console.print("[red]error:[/red] the admin token must be at least 8 characters")
        return 2
    if admin and audit_log is None:
        from bus.server.embedded import default_home

        audit_log = str(default_home() / "dashboard-audit.log")
    if not is_loopback(host):
        console.print(f"[yellow]warning:[/yellow] listening on {host}: anyone who can reach it sees the bus")
    mode = f"admin (audit log: {audit_log})" if admin else "read-only"
    console.print(f"bus dashboard on http://{host}:{port}/  ({mode})  Ctrl-C stops it", markup=False)
    try:
        asyncio.run(serve(host, port, admin_token=token, audit_log=audit_log, refresh=refresh))
    except KeyboardInterrupt:
        pass
    return 0
