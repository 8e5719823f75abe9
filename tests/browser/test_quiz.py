"""The self-test on the hard-questions pages, in Chromium: answers folded, marks remembered."""

from __future__ import annotations

import pytest

from test_site_in_chromium import Problems, _new_page

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
        first.locator(":scope > summary").click()
        first.locator(".handbook-quiz__knew").click()
        second.locator(":scope > summary").click()
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


NAMES = """() => Array.from(document.querySelectorAll("details.question")).map((details) => [
  details.querySelector("summary").textContent.trim(),
  Array.from(details.querySelectorAll(".handbook-quiz__actions button"), (b) => b.getAttribute("aria-label")),
])"""
FOCUSED = "() => document.activeElement === document.querySelectorAll('details.question')[0].querySelector('summary')"
PRESSED = "(sel) => Array.from(document.querySelectorAll(sel), (b) => b.getAttribute('aria-pressed'))"


def test_marks_are_announced_and_keep_the_keyboard_in_place(browser, server) -> None:
    """Pressed states, a name per question, focus back on the question, the tally in a live region."""
    context, page = _new_page(browser)
    problems = Problems(page)
    try:
        page.goto(server + "interview/hard-questions/", wait_until="load")
        names = page.evaluate(NAMES)
        assert names[0][1] == [f"Knew it: {names[0][0]}", f"Review again: {names[0][0]}"]
        labels = [label for _, pair in names for label in pair]
        assert len(set(labels)) == len(labels), "two quiz buttons share a name"
        assert page.locator(".handbook-quiz__count").get_attribute("role") == "status"
        assert set(page.evaluate(PRESSED, ".handbook-quiz__actions button")) == {"false"}

        first = page.locator("article details.question").nth(0)
        first.locator(":scope > summary").click()
        first.locator(".handbook-quiz__knew").focus()
        page.keyboard.press("Enter")
        assert page.evaluate(FOCUSED), "focus left the question it marked"
        assert first.locator(".handbook-quiz__actions button").evaluate_all(
            "(buttons) => buttons.map((b) => b.getAttribute('aria-pressed'))") == ["true", "false"]
        page.keyboard.press("Enter")  # the question's summary still has focus: it opens again
        assert first.get_attribute("open") is not None

        hide = page.locator(".handbook-quiz__hide")
        hide.click()
        assert hide.get_attribute("aria-pressed") == "true" and hide.text_content() == "Hide known"
        assert not first.is_visible()
        hide.click()
        assert hide.get_attribute("aria-pressed") == "false" and first.is_visible()
        page.locator(".handbook-quiz__reset").click()
        assert set(page.evaluate(PRESSED, ".handbook-quiz__actions button")) == {"false"}
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
