"""Make the shared helpers in tests/launch.py importable from every test folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
