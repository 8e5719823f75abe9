# Sourced by serve.sh and test.sh: create .venv once and install the pinned packages.
# EXTRAS selects the optional dependency groups from pyproject.toml.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
# constraints.txt pins every package, torch==2.13.0 included, so pip never reaches
# for a newer torch with gigabytes of CUDA libraries.
"$PY" -m pip install --quiet --disable-pip-version-check \
  -c "$ROOT/constraints.txt" torch==2.13.0 -e "$ROOT[${EXTRAS}]" 2>&1 \
  | grep -v "is neither a file nor a directory" || true
"$PY" -c "import torch, reference_impl" >/dev/null
export NO_MKDOCS_2_WARNING=1
