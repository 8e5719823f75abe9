#!/usr/bin/env bash
# Lint and type-check the package: ruff (style, import order, bug patterns) and mypy, both
# configured in pyproject.toml. Both always run; the exit status is 1 if either found anything.
EXTRAS=tests,biotech,ft  # ruff and mypy, rdkit (whose type stubs mypy reads for reference_impl/bio), torchft
source "$(dirname "$0")/env.sh"
cd "$ROOT"
status=0
"$VENV/bin/ruff" check reference_impl || status=1
"$VENV/bin/mypy" reference_impl || status=1
exit "$status"
