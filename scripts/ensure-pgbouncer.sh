#!/bin/sh
# The tests through a connection pooler start Debian's PgBouncer (scripts/pgbouncer.sh);
# install it when we can (root, apt available). Elsewhere those tests are skipped with a note.
command -v pgbouncer >/dev/null 2>&1 && exit 0
[ -x /usr/sbin/pgbouncer ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q pgbouncer >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q pgbouncer >/dev/null 2>&1)) \
   && echo "installed pgbouncer" && exit 0
fi
echo "note: no pgbouncer found; the tests through a pooler will be skipped" >&2
exit 1
