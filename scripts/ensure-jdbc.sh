#!/bin/sh
# The Spark job reads PostgreSQL over JDBC. Debian ships the driver as
# libpostgresql-jdbc-java; install it when we can (root, apt available).
# Elsewhere set BUS_JDBC_JAR to a driver jar, or let Spark fetch it with
# spark.jars.packages=org.postgresql:postgresql:42.7.4 where there is internet.
[ -f /usr/share/java/postgresql.jar ] && exit 0
[ -n "${BUS_JDBC_JAR:-}" ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q libpostgresql-jdbc-java >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libpostgresql-jdbc-java >/dev/null 2>&1)) \
   && echo "installed libpostgresql-jdbc-java" && exit 0
fi
echo "note: no PostgreSQL JDBC driver found; Spark tests will be skipped unless BUS_JDBC_JAR is set" >&2
exit 1
