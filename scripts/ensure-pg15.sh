#!/bin/sh
# The failover tests run a primary and a streaming standby from Debian's
# PostgreSQL 15 binaries (scripts/pgha.sh). Install them when we can (root,
# apt available); elsewhere set PG15_BIN to a directory holding them.
[ -x "${PG15_BIN:-/usr/lib/postgresql/15/bin}/postgres" ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q postgresql-15 >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q postgresql-15 >/dev/null 2>&1)) \
   && echo "installed postgresql-15" && exit 0
fi
echo "note: no PostgreSQL 15 binaries found; the failover tests will be skipped unless PG15_BIN is set" >&2
exit 1
