"""`calc.memory`'s answers pinned to the bit: every grid point, and many random inputs.

The answers were written by the calculator as it was when this file was made
(`python tests/test_calc_memory_golden.py --write` writes them again, for a change that
means to move them). A change that only rearranges the calculator must leave every byte
of every answer as it was: every key of the answer at each point of the certified grids
(full and reduced, as `memory_grid.predict` asks), and at a few hundred random inputs over
every option (digests of the whole answer, so the file stays small).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from calc_inputs import memory_inputs

from reference_impl import calc
from reference_impl.calc.memory_grid import config_of, grid, predict, reduced_grid

GOLDEN = Path(__file__).with_name("memory_golden.json")
DATA = Path(__file__).resolve().parents[1] / "docs" / "data"
RANDOM_CASES = 600


def _random_inputs() -> list[dict[str, Any]]:
    rng = random.Random("handbook-memory-golden")
    return [memory_inputs(rng) for _ in range(RANDOM_CASES)]


def _digest(answer: dict[str, float]) -> str:
    # json writes a float as its shortest round-tripping repr: equal text means equal bits.
    return hashlib.sha256(json.dumps(answer, sort_keys=True).encode()).hexdigest()[:20]


def _answers() -> dict[str, Any]:
    return {"grid": {c.label: predict(c) for c in grid() + reduced_grid()},
            "random": [_digest(calc.memory(**inputs)) for inputs in _random_inputs()]}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def test_every_grid_answer_is_the_pinned_one(golden: dict[str, Any]) -> None:
    """Each grid point's whole answer equals the pinned one exactly, and the pinned answers are
    the calculator columns of the committed grids (docs/data) exactly."""
    configs = grid() + reduced_grid()
    assert sorted(golden["grid"]) == sorted(c.label for c in configs)
    for config in configs:
        assert predict(config) == golden["grid"][config.label], config.label
    for name in ("memory_grid", "memory_grid_reduced"):
        for row in json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))["data"]["rows"]:
            pinned = golden["grid"][config_of(row).label]
            assert {key: pinned[key] for key in row["calculator"]} == row["calculator"], row["config"]


def test_every_random_answer_is_the_pinned_one(golden: dict[str, Any]) -> None:
    """Random inputs over every option (strategies, recompute, TP/SP/PP/CP, accumulation,
    offload, the compiled loss, steady state and peak): each whole answer's digest is pinned."""
    cases = _random_inputs()
    assert len(golden["random"]) == len(cases)
    changed = [inputs for inputs, pinned in zip(cases, golden["random"], strict=True)
               if _digest(calc.memory(**inputs)) != pinned]
    assert not changed, f"{len(changed)} of {len(cases)} answers changed, first at {changed[0]}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_calc_memory_golden.py --write")
    GOLDEN.write_text(json.dumps(_answers(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
