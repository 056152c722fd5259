#!/bin/sh
# A throwaway PostgreSQL 15 cluster for compatibility runs of the test suite.
#
#   scripts/pg15.sh start   # initdb (first time) and start; prints the DSN
#   scripts/pg15.sh dsn     # the DSN (starts the cluster if it is not running)
#   scripts/pg15.sh stop    # stop it (the data stays under $BUS_HOME/pg15)
#
#   BUS_TEST_DSN=$(scripts/pg15.sh dsn) .venv/bin/python -m pytest -m 'not slow' tests/foundation -q
#
# Uses Debian's PostgreSQL 15 binaries (apt install postgresql-15). The
# cluster listens on 127.0.0.1 at a free port, trust authentication, user
# "postgres". PostgreSQL refuses to run as root, so as root it runs as the
# unprivileged "embedded_postgres" user (created if missing).
set -eu

PGBIN=${PG15_BIN:-/usr/lib/postgresql/15/bin}
HOME_DIR=${BUS_HOME:-./.bus}
mkdir -p "$HOME_DIR"
HOME_DIR=$(cd "$HOME_DIR" && pwd)
DIR=$HOME_DIR/pg15
DATA=$DIR/data
RUN_USER=embedded_postgres

say() { echo "pg15: $*" >&2; }

[ -x "$PGBIN/postgres" ] || { say "no PostgreSQL 15 binaries in $PGBIN (install postgresql-15 or set PG15_BIN)"; exit 1; }

as_server() {
    if [ "$(id -u)" = 0 ]; then
        if command -v runuser >/dev/null 2>&1; then
            runuser -u "$RUN_USER" -- "$@"
        else
            su "$RUN_USER" -s /bin/sh -c '"$0" "$@"' -- "$@"
        fi
    else
        "$@"
    fi
}

prepare() {
    mkdir -p "$DIR"
    if [ "$(id -u)" = 0 ]; then
        id "$RUN_USER" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$RUN_USER"
        chown -R "$RUN_USER" "$DIR"
        # The server user must be able to reach $DIR.
        d=$DIR
        while [ "$d" != / ]; do d=$(dirname "$d"); chmod o+x "$d" 2>/dev/null || true; done
    fi
}

running() {
    [ -f "$DATA/postmaster.pid" ] && as_server "$PGBIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1
}

port() { cat "$DIR/port"; }

dsn() { echo "postgresql://postgres@127.0.0.1:$(port)/postgres"; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    if running; then
        return 0
    fi
    prepare
    if [ ! -f "$DATA/PG_VERSION" ]; then
        say "initdb $DATA"
        as_server "$PGBIN/initdb" -D "$DATA" -U postgres --auth=trust --encoding=UTF8 >/dev/null
    fi
    free_port >"$DIR/port"
    [ "$(id -u)" = 0 ] && chown "$RUN_USER" "$DIR/port"
    say "starting on 127.0.0.1:$(port)"
    as_server "$PGBIN/pg_ctl" -D "$DATA" -l "$DIR/log" -w -t 60 \
        -o "-h 127.0.0.1 -p $(port) -k $DIR -c max_connections=300 -c max_locks_per_transaction=256" \
        start >/dev/null
}

case "${1:-}" in
start)
    start
    dsn
    ;;
dsn)
    start
    dsn
    ;;
stop)
    if running; then
        as_server "$PGBIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null
        say "stopped"
    else
        say "not running"
    fi
    ;;
*)
    echo "usage: $0 start|stop|dsn" >&2
    exit 2
    ;;
esac
