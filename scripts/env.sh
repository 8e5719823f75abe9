# Sourced by serve.sh, test.sh and lint.sh: create .venv once and install the pinned packages.
# EXTRAS selects the optional dependency groups from pyproject.toml.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# One line on stderr before each step that takes a while, named after the script that runs it.
say() { printf '%s: %s\n' "${0##*/}" "$*" >&2; }
if [ ! -x "$PY" ]; then
  say "creating the virtual environment $VENV"
  python3 -m venv "$VENV"
fi
# pip runs only when pyproject.toml or constraints.txt changed since the last install, or an
# extra is asked for that was not installed: a no-op pip run still costs about 20 s. The
# stamp's first line is the two files' hash, the rest the extras installed with it; remove
# it to force a reinstall.
STAMP="$VENV/.handbook-installed"
HASH="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -c1-16)"
installed=""
if [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$HASH" ]; then
  installed="$(tail -n +2 "$STAMP")"
fi
missing=""
for extra in ${EXTRAS//,/ }; do
  grep -qx "$extra" <<<"$installed" || missing="$missing $extra"
done
# uv into the venv, then the torch wheel `$1` and the extras `$2`, bytecode compiled (this
# environment sets PYTHONDONTWRITEBYTECODE, so nothing would compile it later).
uv_install() {
  say "installing uv, then torch ($(basename "$1")) and the extras $2 with it (1-2 minutes the first time on 2 cores)"
  "$PY" -m pip install --quiet --disable-pip-version-check uv==0.13.9 2>&1 \
    | { grep -v "is neither a file nor a directory" || true; } &&
  "$VENV/bin/uv" pip install --quiet --python "$PY" --compile-bytecode \
    -c "$ROOT/constraints.txt" "$1" -e "$ROOT[$2]"
}
if [ -n "$missing" ]; then
  wanted="$(printf '%s\n' $installed ${EXTRAS//,/ } | sort -u | paste -sd, -)"
  # constraints.txt pins every package, torch==2.13.0 included, so neither installer reaches
  # for a newer torch with gigabytes of CUDA libraries. Where pip's find-links folder holds
  # the CPU wheel of torch 2.13.0, uv (pinned) installs that very file and the rest in about
  # a third of pip's time; anywhere else, or if uv fails, pip does it all.
  # The installer's own status decides (pipefail): a failed install stops here and writes
  # no stamp.
  links="${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}"
  wheel="$(ls "$links"/torch-2.13.0*-cp"$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"-*.whl \
    2>/dev/null | head -n 1 || true)"
  if [ -z "$wheel" ] || ! uv_install "$wheel" "$wanted"; then
    say "installing torch 2.13.0 and the extras $wanted with pip (slower than uv: it downloads torch)"
    "$PY" -m pip install --quiet --disable-pip-version-check \
      -c "$ROOT/constraints.txt" torch==2.13.0 -e "$ROOT[${wanted}]" 2>&1 \
      | { grep -v "is neither a file nor a directory" || true; }
  fi
  say "checking that torch and reference_impl import"
  "$PY" -c "import torch, reference_impl" >/dev/null
  printf '%s\n' "$HASH" ${wanted//,/ } >"$STAMP"
fi
export NO_MKDOCS_2_WARNING=1
