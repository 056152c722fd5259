#!/bin/sh
# PgBouncer in front of a PostgreSQL server, for the tests and benchmarks through a pooler.
#
#   PGB_PASSWORD=... scripts/pgbouncer.sh start DIR HOST PORT USER [MODE]   # prints the port it listens on
#   scripts/pgbouncer.sh stop DIR
#
# MODE is PgBouncer's pool_mode (default transaction). Every database of the server is
# reachable through it as the same name. The password comes from the environment and goes
# to DIR/userlist.txt (mode 0600), never onto a command line. PgBouncer refuses to run as
# root, so as root it runs as the unprivileged "embedded_postgres" user (created if missing).
set -eu

say() { echo "pgbouncer: $*" >&2; }
BIN=$(command -v pgbouncer || echo /usr/sbin/pgbouncer)
[ -x "$BIN" ] || { say "not installed (scripts/ensure-pgbouncer.sh installs it)"; exit 1; }
RUN_USER=embedded_postgres

run() {
  if [ "$(id -u)" = "0" ]; then
    id "$RUN_USER" >/dev/null 2>&1 || useradd --system --no-create-home "$RUN_USER"
    runuser -u "$RUN_USER" -- "$@"
  else
    "$@"
  fi
}

cmd=${1:-}
DIR=${2:-}
[ -n "$DIR" ] || { say "usage: $0 start|stop DIR ..."; exit 2; }
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

case "$cmd" in
start)
  HOST=$3; PORT=$4; USER_NAME=$5; MODE=${6:-transaction}
  : "${PGB_PASSWORD:?PGB_PASSWORD must hold the server password}"
  LISTEN=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  umask 077
  printf '"%s" "%s"\n' "$USER_NAME" "$PGB_PASSWORD" > "$DIR/userlist.txt"
  cat > "$DIR/pgbouncer.ini" <<INI
[databases]
* = host=$HOST port=$PORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $LISTEN
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $DIR/userlist.txt
pool_mode = $MODE
max_client_conn = 1000
default_pool_size = 20
ignore_startup_parameters = extra_float_digits
pidfile = $DIR/pgbouncer.pid
logfile = $DIR/pgbouncer.log
INI
  if [ "$(id -u)" = "0" ]; then
    id "$RUN_USER" >/dev/null 2>&1 || useradd --system --no-create-home "$RUN_USER"
    chown -R "$RUN_USER" "$DIR"
  fi
  run "$BIN" -d -q "$DIR/pgbouncer.ini"
  i=0
  until python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $LISTEN), 0.2)" 2>/dev/null; do
    i=$((i + 1)); [ $i -lt 50 ] || { say "did not start; see $DIR/pgbouncer.log"; exit 1; }
    sleep 0.1
  done
  echo "$LISTEN"
  ;;
stop)
  if [ -f "$DIR/pgbouncer.pid" ]; then
    kill "$(cat "$DIR/pgbouncer.pid")" 2>/dev/null || true
    rm -f "$DIR/pgbouncer.pid"
  fi
  ;;
*)
  say "usage: $0 start|stop DIR ..."; exit 2
  ;;
esac
