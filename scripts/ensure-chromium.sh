#!/bin/sh
# The dashboard's browser tests drive Debian's chromium through chromedriver
# (Selenium). Install both when we can (root, apt available); elsewhere set
# BUS_CHROMIUM / BUS_CHROMEDRIVER to a browser and its driver, or the browser
# tests are skipped.
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then exit 0; fi
if [ -n "${BUS_CHROMIUM:-}" ] && [ -n "${BUS_CHROMEDRIVER:-}" ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) \
   && echo "installed chromium and chromium-driver" && exit 0
fi
echo "note: no chromium/chromedriver found; the dashboard's browser tests will be skipped" >&2
exit 1
