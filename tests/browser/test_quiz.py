"""The self-test on the hard-questions pages, in Chromium: answers folded, marks remembered."""

from __future__ import annotations

import pytest

from test_site_in_chromium import Problems, _new_page, browser, server  # noqa: F401 - fixtures

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(120)]

COUNT = "() => document.querySelector('.handbook-quiz__count').textContent"


@pytest.mark.parametrize("path", ["interview/hard-questions/", "biotech/hard-questions/"])
def test_marks_survive_a_reload_and_known_questions_can_be_hidden(browser, server, path: str) -> None:
    context, page = _new_page(browser)
    problems = Problems(page)
    try:
        page.goto(server + path, wait_until="load")
        questions = page.locator("article details.question")
        total = questions.count()
        assert total > 10
        assert page.locator("article details.question[open]").count() == 0, "every answer starts folded"
        assert page.evaluate(COUNT).endswith(f"{total - 0} not tried, of {total}")

        first, second = questions.nth(0), questions.nth(1)
        first.locator("summary").click()
        first.locator(".handbook-quiz__knew").click()
        second.locator("summary").click()
        second.locator(".handbook-quiz__again").click()
        assert page.evaluate(COUNT).startswith("1 known · 1 to review")

        page.reload(wait_until="load")  # the browser remembers
        assert page.evaluate(COUNT) == f"1 known · 1 to review · {total - 2} not tried, of {total}"
        assert questions.nth(0).get_attribute("data-quiz") == "knew"
        page.locator(".handbook-quiz__hide").click()
        assert not questions.nth(0).is_visible() and questions.nth(1).is_visible()

        page.locator(".handbook-quiz__reset").click()
        assert page.evaluate(COUNT).startswith("0 known · 0 to review")
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
