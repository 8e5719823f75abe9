#!/usr/bin/env bash
# Install everything the suite needs and run every test.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/docs -k codeblocks`.
EXTRAS=docs,tests,biotech,ft
source "$(dirname "$0")/env.sh"
cd "$ROOT"
# The browser test drives the operating system's Chromium (no browser download);
# CHROMIUM may point at another Chromium-based browser that is already installed.
if [ ! -x "${CHROMIUM:-/usr/bin/chromium}" ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium fonts-liberation >/dev/null
fi
# Two workers, one per core: the suite is CPU-bound (about 1,150 CPU-seconds of tests, 11 min on a quiet 2-core
# machine; a third worker ran them no faster, with the CPU idle 0.2% of the time). A later -n in "$@" wins: -n 0 runs
# everything in this process. Whole files go to a worker, longest first (tests/conftest.py orders them; xdist's
# own reordering by test count is off), so that a file's shared set-up is built once and the two workers
# finish together.
exec "$PY" -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
