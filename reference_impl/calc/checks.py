"""The input checks every calculator shares: each returns the value or raises `ValueError` with
the message its JavaScript twin throws."""

from __future__ import annotations

import math
from typing import Any


def number(name: str, value: Any) -> float:
    # bool is an int in Python but not a number in JavaScript: reject it in both.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def positive(name: str, value: Any) -> float:
    if number(name, value) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def non_negative(name: str, value: Any) -> float:
    if number(name, value) < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return float(value)


def count(name: str, value: Any, minimum: int = 1) -> int:
    # A whole number given as a float (2.0) is accepted: JavaScript cannot tell them apart.
    if number(name, value) != math.floor(value) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value
