#!/usr/bin/env bash
# Build the handbook and print it to handbook.pdf (or the path given) with headless Chromium,
# offline: the all-in-one page, through the site's print stylesheet, diagrams drawn.
# CHROMIUM may point at another Chromium-based browser (default /usr/bin/chromium).
EXTRAS=docs,tests
source "$(dirname "$0")/env.sh"
OUT="$(realpath -m "${1:-$ROOT/handbook.pdf}")"
cd "$ROOT"
SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
"$VENV/bin/mkdocs" build --quiet --strict --site-dir "$SITE"
"$PY" scripts/handbook_pdf.py "$SITE" "$OUT"
