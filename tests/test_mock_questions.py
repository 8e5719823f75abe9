"""The mock interview's question bank: answers equal closed forms, and the bank is large.

Each template's answer, computed by a calculator of `reference_impl.calc` through the
template's data, must equal the textbook formula for what its question asks, written out
here independently, on every combination of the template's choices and after each
follow-up. That catches a template wired to the wrong input, output or unit as well as a
calculator that drifted.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from reference_impl.interview import mock_questions as mq

ROOT = Path(__file__).resolve().parents[1]
GB, MB = 1e9, 1e6


def _bubble(p: dict) -> float:
    v, m, s = p.get("interleave", 1), p["microbatches"], p["stages"]
    busy = 3 * v * m if p.get("schedule") == "zero_bubble" else v * m
    return 100 * (s - 1) / (busy + s - 1)


def _young(p: dict) -> float:
    return math.sqrt(2 * p["cost_s"] * p["mtbf_h"] * 3600)


_SHARDED = {"ddp": 0, "zero1": 12, "zero2": 14}  # bytes per parameter divided by N
CLOSED_FORMS: dict[str, Callable[[dict], float]] = {
    "zero3_model_state": lambda p: 16 * p["params_b"] * 1e9 / p["world_size"] / GB,
    "partial_sharding_state": lambda p: p["params_b"] * 1e9 * (
        16 - _SHARDED[p["strategy"]] + _SHARDED[p["strategy"]] / p["world_size"]) / GB,
    "activations_per_layer": lambda p: 34 * p["seq_len"] * p["micro_batch"] * p["hidden"] / GB,
    "checkpointed_activations": lambda p: (2 * p["n_layers"] + 34) * p["seq_len"] * p["hidden"] / GB,
    "ddp_allreduce_bytes": lambda p: 2 * (p["world_size"] - 1) / p["world_size"] * 2 * p["params_b"] * 1e9 / GB,
    "ddp_allreduce_time": lambda p: 2 * (p["world_size"] - 1) / p["world_size"] * 2 * p["params_b"]
    / p["bandwidth_gbps"] * 1e3,
    "fsdp_bytes": lambda p: (3 if p["reshard_after_forward"] else 2) * (p["world_size"] - 1) / p["world_size"]
    * 2 * p["params_b"] * 1e9 / GB,
    "tp_bytes": lambda p: p["n_layers"] * 4 * 2 * (p["tp_degree"] - 1) / p["tp_degree"] * 2 * p["micro_batch"]
    * p["seq_len"] * p["hidden"] / GB,
    "pp_bytes": lambda p: (2 if p["stages"] > 2 else 1) * 2 * p["micro_batch"] * p["seq_len"] * p["hidden"] / MB,
    "moe_all_to_all": lambda p: (p["ep"] - 1) / p["ep"] * p["tokens"] * p["top_k"] * p["hidden"] * 2 / MB,
    "bubble_1f1b": _bubble,
    "bubble_schedules": _bubble,
    "young_interval": lambda p: _young(p) / 60,
    "young_overhead": lambda p: 100 * math.sqrt(2 * p["cost_s"] / (p["mtbf_h"] * 3600)),
    "mfu_from_throughput": lambda p: 100 * 6 * p["params_b"] * 1e9 * p["tokens_per_s"] / 989e12,
    "step_time_from_mfu": lambda p: 6 * p["params_b"] * 1e9 * p["tokens_m"] * 1e6
    / (p["n_gpus"] * p["peak_tflops"] * 1e12 * p["mfu_pct"] / 100),
}


def _chain(template: dict, params: dict) -> list[dict]:
    """The question and each of its follow-ups, in the order the page asks them."""
    chain = [params]
    for index in range(len(template["follow_ups"])):
        chain.append(mq.follow_up(template, chain[-1], index))
    return chain


@pytest.mark.parametrize("template", mq.TEMPLATES, ids=[t["id"] for t in mq.TEMPLATES])
def test_every_answer_equals_the_closed_form_on_every_question_and_follow_up(template: dict) -> None:
    closed = CLOSED_FORMS[template["id"]]
    for params in mq.combinations(template):
        for asked in _chain(template, params):
            got = mq.answer(template, asked)
            assert got == pytest.approx(closed(asked), rel=1e-9), (template["id"], asked)
            assert got > 0 and math.isfinite(got)


@pytest.mark.parametrize("template", mq.TEMPLATES, ids=[t["id"] for t in mq.TEMPLATES])
def test_seeded_draws_are_questions_of_the_bank_with_the_calculators_answer(template: dict) -> None:
    rng = random.Random(template["id"])
    bank = list(mq.combinations(template))
    for _ in range(50):
        params = mq.draw(template, rng)
        assert params in bank
        inputs = mq.resolve(template, params)
        direct = getattr(mq.calc, template["calc"])(**inputs)[template["key"]] / template["unit_scale"]
        assert mq.answer(template, params) == direct


def test_the_bank_holds_at_least_150_distinct_questions_over_at_least_15_templates() -> None:
    distinct = {(t["id"], json.dumps(p, sort_keys=True)) for t in mq.TEMPLATES for p in mq.combinations(t)}
    assert len(distinct) == mq.bank_size() >= 150
    assert len(mq.TEMPLATES) >= 15 and set(CLOSED_FORMS) == {t["id"] for t in mq.TEMPLATES}
    topics = {t["topic"] for t in mq.TEMPLATES}
    assert topics >= {"memory", "bytes moved", "bubble", "MFU", "checkpoint interval", "all-to-all"}
    assert all(t["follow_ups"] for t in mq.TEMPLATES), "every template has a follow-up"


def test_every_placeholder_names_a_parameter_and_mfu_answers_are_fractions() -> None:
    for t in mq.TEMPLATES:
        texts = [t["question"], t["formula"], *(f["say"] for f in t["follow_ups"])]
        named = {name for text in texts for name in re.findall(r"\{(\w+)\}", text)}
        assert named <= set(t["params"]), (t["id"], named - set(t["params"]))
        assert {f["param"] for f in t["follow_ups"]} <= set(t["params"])
    mfu = next(t for t in mq.TEMPLATES if t["id"] == "mfu_from_throughput")
    assert all(0 < mq.answer(mfu, q) <= 100 for p in mq.combinations(mfu) for q in _chain(mfu, p))


def test_the_pages_copy_of_the_bank_is_current_and_shares_the_quiz_storage() -> None:
    assert mq.main(["--check"]) == 0, "run: python -m reference_impl.interview.mock_questions"
    prefix = re.search(r'const PREFIX = "([^"]+)"', (ROOT / "docs/javascripts/quiz.js").read_text())
    assert prefix, "quiz.js no longer names its storage prefix"
    assert f'var QUIZ_PREFIX = "{prefix[1]}"' in (ROOT / "docs/javascripts/mock.js").read_text()
