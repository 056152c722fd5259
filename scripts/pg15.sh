#!/bin/sh
# A throwaway PostgreSQL 15 cluster for compatibility runs of the test suite.
#
#   scripts/pg15.sh start   # initdb (first time) and start; prints the DSN
#   scripts/pg15.sh dsn     # the DSN (starts the cluster if it is not running)
#   scripts/pg15.sh stop    # stop it (the data stays under $BUS_HOME/pg15)
#   scripts/pg15.sh outage SECONDS   # stop it (-m fast), wait, start it again on the same port
#
#   BUS_TEST_DSN=$(scripts/pg15.sh dsn) .venv/bin/python -m pytest -m 'not slow' tests/foundation -q
#
# The server keeps Debian's default configuration (JIT on, as packaged
# servers have it); $PG15_OPTS adds server options to a start, such as
# "-c shared_preload_libraries=pg_stat_statements".
#
# Uses Debian's PostgreSQL 15 binaries (apt install postgresql-15). The
# cluster listens on 127.0.0.1 at a free port, user "postgres", authenticated
# like the embedded server: a random password in $BUS_HOME/pg15/password
# (mode 0600) for TCP (scram-sha-256), trust only on the unix socket in the
# owner-only directory $BUS_HOME/pg15, no replication. `dsn` prints the DSN
# with the password (it is meant for BUS_TEST_DSN=$(...)). PostgreSQL refuses
# to run as root, so as root it runs as the unprivileged "embedded_postgres"
# user (created if missing).
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
    chmod 700 "$DIR" # the unix socket lives here: only its owner may reach it
    if [ ! -s "$DIR/password" ]; then
        (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(24))' >"$DIR/password")
    fi
    chmod 600 "$DIR/password"
    if [ "$(id -u)" = 0 ]; then
        id "$RUN_USER" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$RUN_USER"
        chown -R "$RUN_USER" "$DIR"
        chown root "$DIR/password" # the server never reads it; only this script does
        # The server user must be able to reach $DIR.
        d=$DIR
        while [ "$d" != / ]; do d=$(dirname "$d"); chmod o+x "$d" 2>/dev/null || true; done
    fi
}

running() {
    [ -f "$DATA/postmaster.pid" ] && as_server "$PGBIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1
}

port() { cat "$DIR/port"; }

password() { cat "$DIR/password"; }

dsn() { echo "postgresql://postgres:$(password)@127.0.0.1:$(port)/postgres"; }

# Rewritten at every start (an older cluster made with trust everywhere is secured too).
write_hba() {
    cat >"$DATA/pg_hba.conf" <<'HBA'
# Written by scripts/pg15.sh at each start.
local   all   all                  trust
host    all   all   127.0.0.1/32   scram-sha-256
host    all   all   ::1/128        scram-sha-256
HBA
    [ "$(id -u)" = 0 ] && chown "$RUN_USER" "$DATA/pg_hba.conf"
    return 0
}

# Through the socket and stdin: the password never shows on a command line.
set_password() {
    printf "ALTER ROLE postgres PASSWORD '%s';\n" "$(password)" |
        as_server "$PGBIN/psql" -X -q -h "$DIR" -p "$(port)" -U postgres -d postgres -v ON_ERROR_STOP=1 >/dev/null
}

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
        as_server "$PGBIN/initdb" -D "$DATA" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
            --encoding=UTF8 >/dev/null
    fi
    write_hba
    [ -n "${KEEP_PORT:-}" ] || free_port >"$DIR/port"
    [ "$(id -u)" = 0 ] && chown "$RUN_USER" "$DIR/port"
    say "starting on 127.0.0.1:$(port)"
    as_server "$PGBIN/pg_ctl" -D "$DATA" -l "$DIR/log" -w -t 60 \
        -o "-h 127.0.0.1 -p $(port) -k $DIR -c max_connections=300 -c max_locks_per_transaction=256 ${PG15_OPTS:-}" \
        start >/dev/null
    set_password
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
outage)
    seconds=${2:?usage: $0 outage SECONDS}
    running || { say "not running"; exit 1; }
    as_server "$PGBIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null
    say "stopped for $seconds s"
    sleep "$seconds"
    KEEP_PORT=1 start
    ;;
*)
    echo "usage: $0 start|stop|dsn|outage SECONDS" >&2
    exit 2
    ;;
esac
