"""What every component of the training config shares: the error, the checks, the field docs.

Each component is a frozen dataclass that inherits `Options`: constructing it alone runs
its own `validate`, which looks at its own fields only. `TrainConfig` inherits every
component and runs each one's `validate` before the checks that span components.
"""

# --8<-- [start:base]
from __future__ import annotations

import ast
import inspect
import math
import os
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

NAME_MAX = 255  # bytes per path component on Linux file systems


class ConfigError(ValueError):
    """A flag or a combination of flags that cannot describe a valid run."""


def fail(message: str) -> None:
    """Raise the one-line `ConfigError` the CLI prints."""
    raise ConfigError(message)


class Options:
    """Base of every option component: construction validates the component's own fields."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check this component's own fields; overridden by every component."""


def choices_of(cls: type, name: str) -> tuple[str, ...] | None:
    """The values a `Literal` field of `cls` accepts, or None for other fields."""
    hint = get_type_hints(cls).get(name)
    return tuple(get_args(hint)) if get_origin(hint) is Literal else None


def check_choices(obj: Any, cls: type) -> None:
    """Every `Literal` field of the component `cls` holds one of its values."""
    for f in fields(cls):
        choices = choices_of(cls, f.name)
        if choices and getattr(obj, f.name) not in choices:
            fail(f"{f.name} must be one of {', '.join(choices)} (got {getattr(obj, f.name)!r})")


def at_least(obj: Any, bound: int, *names: str) -> None:
    """Each named integer field is at least `bound` (1 for sizes and counts, 0 for offsets)."""
    for name in names:
        if getattr(obj, name) < bound:
            fail(f"{name} must be >= {bound} (got {getattr(obj, name)})")


# The largest float32: a learning rate, a decay or a loss scale above it overflows the
# first tensor op that uses it, deep in the optimizer, instead of failing here.
FLOAT32_MAX = 3.4028234663852886e38


def positive_finite(obj: Any, *names: str, most: float = FLOAT32_MAX) -> None:
    """Each named float field is finite, above 0 and at most `most`."""
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value > 0):
            fail(f"{name} must be a positive finite number (got {value})")
        if value > most:
            fail(f"{name} must be at most {most:g} (got {value:g})")


def finite_non_negative(obj: Any, *names: str, most: float = FLOAT32_MAX) -> None:
    """Each named float field is finite, at least 0 and at most `most`."""
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value >= 0):
            fail(f"{name} must be a finite number >= 0 (got {value})")
        if value > most:
            fail(f"{name} must be at most {most:g} (got {value:g})")


def short_path_parts(obj: Any, *names: str) -> None:
    """Each named path field is unset or a non-empty path no component of which is longer
    than the file system allows (an empty one, from an unset shell variable, would quietly
    turn the feature off)."""
    for name in names:
        path = getattr(obj, name)
        if path == "":
            fail(f"{name} is empty; leave the flag out to run without one")
        if path and any(len(os.fsencode(part)) > NAME_MAX for part in path.split(os.sep)):  # undecodable bytes too
            fail(f"{name} has a path component longer than {NAME_MAX} bytes")


def class_field_docs(cls: type) -> dict[str, str]:
    """Map each field declared in `cls` to the docstring written under it in the source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = str(nxt.value.value)
    return docs
# --8<-- [end:base]
