"""Self-test mode: the question bank, and the Anki deck built from it with the site."""

from __future__ import annotations

import html
import re
import sqlite3
import sys
import zipfile
from pathlib import Path

import pytest

import handbook_docs_support as support

sys.path.insert(0, str(support.DOCS / "hooks"))
import handbook  # noqa: E402

pytestmark = pytest.mark.docs


def test_the_question_bank_holds_every_hard_question_with_its_proof() -> None:
    bank = handbook.question_bank()
    on_pages = sum((support.DOCS / p).read_text(encoding="utf-8").count('??? question "')
                   for p in handbook.QUESTION_PAGES)
    assert len(bank) == on_pages > 50
    assert all(card["answer"] and card["topic"] for card in bank), "no empty answer, every card has a topic"
    cited = [card for card in bank if "tests/" in card["answer"]]
    assert cited and all(card["tests"] for card in cited), "a cited test becomes the card's proof link"


def test_the_site_ships_an_anki_deck_with_one_card_per_question(built_site: Path, tmp_path: Path) -> None:
    deck = built_site / handbook.DECK_PATH
    with zipfile.ZipFile(deck) as package:
        package.extract("collection.anki2", tmp_path)
    db = sqlite3.connect(tmp_path / "collection.anki2")
    try:
        notes = [row[0].split("\x1f") for row in db.execute("select flds from notes")]
    finally:
        db.close()
    bank = handbook.question_bank()
    assert len(notes) == len(bank)
    by_question = {html.unescape(re.sub(r"<[^>]+>", "", fields[0])).strip(): fields for fields in notes}
    for card in bank:
        question, answer, source = by_question[card["question"].replace("`", "")]
        assert answer.strip()
        for test in card["tests"]:
            assert test in source, f"the card for {card['question']!r} must link {test}"
    page = (built_site / "interview" / "hard-questions" / "index.html").read_text(encoding="utf-8")
    assert 'href="../hard-questions.apkg"' in page
