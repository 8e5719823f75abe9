"""Run a script or module in an interpreter where `import reference_impl` fails.

This is how a candidate's blank notebook looks: torch and numpy, but not this package.
The finder goes first on `sys.meta_path`, so neither the editable install nor a
`reference_impl/` folder in the working directory can satisfy the import.

    python tests/without_package.py path/to/script.py [args...]
    python tests/without_package.py -m ipykernel_launcher -f CONNECTION_FILE
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys

HIDDEN = "hidden: a blank notebook has no reference_impl"  # in every refusal's message


class _BlockPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - finder protocol
        if name == "reference_impl" or name.startswith("reference_impl."):
            raise ModuleNotFoundError(f"No module named {name!r} ({HIDDEN})", name=name)
        return None


def block() -> None:
    """Make every later `import reference_impl...` fail in this interpreter."""
    for name in [m for m in sys.modules if m == "reference_impl" or m.startswith("reference_impl.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _BlockPackage())


if __name__ == "__main__":
    block()
    if sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
