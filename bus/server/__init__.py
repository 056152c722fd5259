"""The embedded PostgreSQL server a Bus starts when it is given no DSN (`bus server ...` drives it).

Not SQL, so not in `storage/`: it manages a server process, its data
directory, its password and the processes that use it. `embedded` holds it
all; the names here are what the Bus, the CLI and the test plugin use.
"""

from bus.server.embedded import (
    PASSWORD_FILE,
    EmbeddedServer,
    ServerStatus,
    default_home,
    ensure_server,
    mask_dsn,
    release_server,
    restart_server,
    scram_verifier,
    server_status,
    stop_server,
)

__all__ = [
    "PASSWORD_FILE",
    "EmbeddedServer",
    "ServerStatus",
    "default_home",
    "ensure_server",
    "mask_dsn",
    "release_server",
    "restart_server",
    "scram_verifier",
    "server_status",
    "stop_server",
]
