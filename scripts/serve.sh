#!/usr/bin/env bash
# Install the docs toolchain and serve the handbook on http://127.0.0.1:8000
EXTRAS=docs
source "$(dirname "$0")/env.sh"
cd "$ROOT"
say "building the handbook, then serving it on http://127.0.0.1:8000 (Ctrl-C stops)"
exec "$VENV/bin/mkdocs" serve --dev-addr 127.0.0.1:8000 "$@"
