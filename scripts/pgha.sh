#!/bin/sh
# A throwaway PostgreSQL 15 primary and streaming standby, for failover tests.
#
#   scripts/pgha.sh start          # initdb, pg_basebackup, start both; prints the multi-host DSN
#   scripts/pgha.sh dsn            # the multi-host DSN (target_session_attrs=read-write)
#   scripts/pgha.sh promote        # promote the standby (pg_ctl promote)
#   scripts/pgha.sh stop-primary   # stop the primary at once (-m immediate: a crash)
#   scripts/pgha.sh stop           # stop both and remove the data
#
# Uses Debian's PostgreSQL 15 binaries (scripts/ensure-pg15.sh). Both servers
# listen on 127.0.0.1 at free ports. Replication is synchronous: the primary
# runs with synchronous_standby_names=standby and synchronous_commit=on, so a
# commit returns only once the standby has flushed it. The setting is given on
# the primary's command line, not in its configuration files, so the promoted
# standby does not wait for a standby it does not have. Passwords live in
# files only: $DIR/password (mode 0600) and a libpq passfile the servers and
# pg_basebackup read; none is on a command line. As root the servers run as
# the unprivileged "embedded_postgres" user. $PGHA_DIR (default
# $BUS_HOME/pgha) holds everything.
set -eu

PGBIN=${PG15_BIN:-/usr/lib/postgresql/15/bin}
HOME_DIR=${BUS_HOME:-./.bus}
mkdir -p "$HOME_DIR"
HOME_DIR=$(cd "$HOME_DIR" && pwd)
DIR=${PGHA_DIR:-$HOME_DIR/pgha}
RUN_USER=embedded_postgres

say() { echo "pgha: $*" >&2; }

[ -x "$PGBIN/postgres" ] || { say "no PostgreSQL 15 binaries in $PGBIN (install postgresql-15 or set PG15_BIN)"; exit 1; }

as_server() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u "$RUN_USER" -- "$@"
    else
        "$@"
    fi
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

password() { cat "$DIR/password"; }
port() { cat "$DIR/$1.port"; }

dsn() {
    echo "postgresql://postgres:$(password)@127.0.0.1:$(port primary),127.0.0.1:$(port standby)/postgres?target_session_attrs=read-write"
}

running() {
    [ -f "$DIR/$1/postmaster.pid" ] && as_server "$PGBIN/pg_ctl" -D "$DIR/$1" status >/dev/null 2>&1
}

prepare() {
    mkdir -p "$DIR"
    chmod 700 "$DIR"
    if [ ! -s "$DIR/password" ]; then
        (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(24))' >"$DIR/password")
    fi
    chmod 600 "$DIR/password"
    free_port >"$DIR/primary.port"
    free_port >"$DIR/standby.port"
    # libpq passfile: the standby's walreceiver and pg_basebackup read it.
    (umask 077 && {
        echo "127.0.0.1:$(port primary):*:postgres:$(password)"
        echo "127.0.0.1:$(port standby):*:postgres:$(password)"
    } >"$DIR/pgpass")
    if [ "$(id -u)" = 0 ]; then
        id "$RUN_USER" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$RUN_USER"
        chown -R "$RUN_USER" "$DIR"
        chown root "$DIR/password"
        d=$DIR
        while [ "$d" != / ]; do d=$(dirname "$d"); chmod o+x "$d" 2>/dev/null || true; done
    fi
}

hba() {
    cat >"$1/pg_hba.conf" <<'HBA'
# Written by scripts/pgha.sh.
local   all           all                  trust
host    all           all   127.0.0.1/32   scram-sha-256
host    replication   all   127.0.0.1/32   scram-sha-256
HBA
    [ "$(id -u)" = 0 ] && chown "$RUN_USER" "$1/pg_hba.conf"
    return 0
}

OPTS="-c max_connections=300 -c max_locks_per_transaction=256 -c wal_level=replica -c max_wal_senders=5 -c hot_standby=on -c wal_sender_timeout=5s -c wal_receiver_status_interval=1s"

start_primary() {
    as_server "$PGBIN/pg_ctl" -D "$DIR/primary" -l "$DIR/primary.log" -w -t 60 \
        -o "-h 127.0.0.1 -p $(port primary) -k $DIR $OPTS -c synchronous_standby_names=standby -c synchronous_commit=on" \
        start >/dev/null
}

start_standby() {
    as_server "$PGBIN/pg_ctl" -D "$DIR/standby" -l "$DIR/standby.log" -w -t 60 \
        -o "-h 127.0.0.1 -p $(port standby) -k $DIR $OPTS" start >/dev/null
}

start() {
    if running primary || running standby; then
        dsn
        return 0
    fi
    rm -rf "$DIR/primary" "$DIR/standby"
    prepare
    (umask 077 && cp "$DIR/password" "$DIR/pwfile")
    [ "$(id -u)" = 0 ] && chown "$RUN_USER" "$DIR/pwfile"
    as_server "$PGBIN/initdb" -D "$DIR/primary" -U postgres --pwfile="$DIR/pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 >/dev/null
    rm -f "$DIR/pwfile"
    hba "$DIR/primary"
    say "primary on 127.0.0.1:$(port primary)"
    start_primary
    # The standby's copy; -R writes primary_conninfo (with the passfile, no password) and standby.signal.
    as_server env PGPASSFILE="$DIR/pgpass" "$PGBIN/pg_basebackup" -h 127.0.0.1 -p "$(port primary)" \
        -U postgres -D "$DIR/standby" -X stream -c fast --no-password >/dev/null
    echo "primary_conninfo = 'host=127.0.0.1 port=$(port primary) user=postgres passfile=''$DIR/pgpass'' application_name=standby'" \
        >>"$DIR/standby/postgresql.auto.conf"
    touch "$DIR/standby/standby.signal"
    [ "$(id -u)" = 0 ] && chown "$RUN_USER" "$DIR/standby/standby.signal"
    say "standby on 127.0.0.1:$(port standby)"
    start_standby
    # Wait until the standby streams synchronously.
    i=0
    until [ "$(as_server "$PGBIN/psql" -X -qAt -h "$DIR" -p "$(port primary)" -U postgres -d postgres \
        -c "select count(*) from pg_stat_replication where sync_state = 'sync'")" = 1 ]; do
        i=$((i + 1))
        [ $i -gt 600 ] && { say "standby not streaming (see $DIR/*.log)"; exit 1; }
        sleep 0.1
    done
    dsn
}

case "${1:-}" in
start) start ;;
dsn) dsn ;;
promote)
    as_server "$PGBIN/pg_ctl" -D "$DIR/standby" -w -t 60 promote >/dev/null
    say "standby promoted"
    ;;
stop-primary)
    if running primary; then as_server "$PGBIN/pg_ctl" -D "$DIR/primary" -m immediate -w stop >/dev/null; fi
    say "primary stopped"
    ;;
stop)
    for n in primary standby; do
        if [ -f "$DIR/$n/postmaster.pid" ]; then
            as_server "$PGBIN/pg_ctl" -D "$DIR/$n" -m immediate -w stop >/dev/null 2>&1 ||
                kill -QUIT "$(head -1 "$DIR/$n/postmaster.pid")" 2>/dev/null || true
        fi
    done
    rm -rf "$DIR/primary" "$DIR/standby"
    say "stopped"
    ;;
*)
    echo "usage: $0 start|dsn|promote|stop-primary|stop" >&2
    exit 2
    ;;
esac
