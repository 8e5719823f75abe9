"""The numeric mock interview in Chromium: the page's answers are the Python bank's.

The page draws a question with a fixed seed; its answer, from `window.handbookCalc`, must
equal `reference_impl.interview.mock_questions.answer` for the numbers it drew, and so must the
page's answers for seeded draws of every template. A wrong answer marked "Review again"
must land in the quiz's storage (the review list) and stay there when the follow-up, which
changes one number, goes well; the clock must show the time left of the chosen mode.
"""

from __future__ import annotations

import random
import re

import pytest
from test_site_in_chromium import Problems, _new_page

from reference_impl.interview import mock_questions as mq

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(120)]

PAGE = "practice/mock-interview/"
ANSWERS = "(cases) => cases.map(([id, params]) => window.handbookMock.answer(id, params))"
STORED = "(key) => localStorage.getItem(key)"


def _start(page, minutes: int, seed: int) -> dict:
    page.evaluate("(n) => window.handbookMock.seed(n)", seed)
    page.select_option(".handbook-mock__mode", str(minutes))
    page.click(".handbook-mock__start")
    return page.evaluate("() => window.handbookMock.current()")


def test_mock_interview_draws_grades_and_times(browser, server) -> None:
    context, page = _new_page(browser)
    problems = Problems(page)
    templates = {t["id"]: t for t in mq.TEMPLATES}
    try:
        page.goto(server + PAGE, wait_until="load")
        page.wait_for_selector(".handbook-mock[data-ready=true]")

        # Every template, seeded draws: the browser's calculators give the Python answers.
        rng = random.Random(0)
        cases = [[t["id"], mq.draw(t, rng)] for t in mq.TEMPLATES for _ in range(10)]
        got = page.evaluate(ANSWERS, cases)
        for (tid, params), value in zip(cases, got, strict=True):
            assert value == pytest.approx(mq.answer(templates[tid], params), rel=1e-9), (tid, params)

        first = _start(page, 15, seed=7)
        assert re.fullmatch(r"1[45]:\d\d left", page.text_content(".handbook-mock__timer"))
        template = templates[first["id"]]
        assert first["step"] == -1 and first["params"] in list(mq.combinations(template))
        assert first["answer"] == pytest.approx(mq.answer(template, first["params"]), rel=1e-9)
        assert page.text_content(".handbook-mock__unit") == template["unit"]

        page.fill(".handbook-mock__answer", repr(first["answer"] * 3))  # wrong: three times too high
        page.click(".handbook-mock__check")
        assert "too high" in page.text_content(".handbook-mock__verdict")
        assert page.text_content(".handbook-mock__formula").endswith(template["unit"])
        page.click(".handbook-mock__again")
        key = "handbook-quiz:/" + PAGE + "#" + template["title"]
        assert page.evaluate(STORED, key) == "again", "the mark is not in the quiz's storage"
        assert template["title"] in page.text_content(".handbook-mock__review")

        # The follow-up changes one number of the same question and is answered anew.
        follow = page.evaluate("() => window.handbookMock.current()")
        assert follow["id"] == first["id"] and follow["step"] == 0
        assert follow["params"] == mq.follow_up(template, first["params"], 0)
        assert follow["answer"] == pytest.approx(mq.answer(template, follow["params"]), rel=1e-9)
        page.fill(".handbook-mock__answer", repr(follow["answer"]))
        page.click(".handbook-mock__check")
        assert page.text_content(".handbook-mock__verdict").startswith("Within 10%")
        page.click(".handbook-mock__knew")
        assert page.evaluate(STORED, key) == "again", "a right follow-up cleared the miss"

        page.reload(wait_until="load")  # the same seed draws the same question; the mark stays
        page.wait_for_selector(".handbook-mock[data-ready=true]")
        assert template["title"] in page.text_content(".handbook-mock__review")
        assert _start(page, 45, seed=7) == first
        assert re.fullmatch(r"4[45]:\d\d left", page.text_content(".handbook-mock__timer"))
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
