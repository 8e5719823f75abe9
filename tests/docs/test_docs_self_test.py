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
import facts  # noqa: E402
import handbook  # noqa: E402

pytestmark = pytest.mark.docs


def test_the_question_bank_holds_every_hard_question_with_its_proof() -> None:
    bank = handbook.question_bank()
    on_pages = sum((support.DOCS / p).read_text(encoding="utf-8").count('??? question "')
                   for p in handbook.QUESTION_PAGES)
    assert len(bank) == on_pages > 50
    assert all(card["answer"] and card["topic"] for card in bank), "no empty answer, every card has a topic"
    folded = sum('??? proof "How we know"' in m["body"] for page in handbook.QUESTION_PAGES
                 for m in handbook.QUESTION.finditer((support.DOCS / page).read_text(encoding="utf-8")))
    assert folded > 40 and sum(bool(card["tests"]) for card in bank) == folded, (
        "the tests a question's fold names become its card's proof links")
    assert not any("tests/" in card["answer"] or "??? proof" in card["answer"] for card in bank), (
        "a card's answer is the answer; its proof rides in the source line")


def _questions_under_headings() -> list[tuple[str, str, str]]:
    """(page, question, the `## ` heading above it) for every hard question, read line by line."""
    found = []
    for page in handbook.QUESTION_PAGES:
        heading = ""
        for line in facts.expand((support.DOCS / page).read_text(encoding="utf-8")).splitlines():
            if line.startswith("## "):
                heading = line[3:].strip()
            elif line.startswith('??? question "') and line.endswith('"'):
                found.append((page, line[len('??? question "'):-1], heading))
    return found


def _deck_notes(deck: Path, tmp_path: Path) -> list[list[str]]:
    """The fields of every note in an Anki package: question, answer and source (HTML)."""
    with zipfile.ZipFile(deck) as package:
        package.extract("collection.anki2", tmp_path)
    db = sqlite3.connect(tmp_path / "collection.anki2")
    try:
        notes = [row[0].split("\x1f") for row in db.execute("select flds from notes")]
    finally:
        db.close()
    return notes


def _by_question(notes: list[list[str]]) -> dict[str, list[str]]:
    """The notes by their question's text: tags removed, so inline code loses its backticks."""
    return {html.unescape(re.sub(r"<[^>]+>", "", fields[0])).strip(): fields for fields in notes}


def test_every_card_is_filed_under_the_heading_it_sits_under_on_its_page(tmp_path: Path) -> None:
    """A card's topic, in the bank and on its Anki card, is the section heading above the
    question on its page: a card filed under another section fails here."""
    on_pages = _questions_under_headings()
    assert len({heading for _, _, heading in on_pages}) >= 8, "both pages are split into sections"
    bank = [(card["page"], card["question"], card["topic"]) for card in handbook.question_bank()]
    assert bank == on_pages
    site_url = "https://handbook.example/"
    assert handbook.build_deck(tmp_path / "deck.apkg", site_url, None) == len(on_pages)
    notes = _by_question(_deck_notes(tmp_path / "deck.apkg", tmp_path))
    for page, question, heading in on_pages:
        source = notes[question.replace("`", "")][2]
        page_url = site_url + page.removesuffix(".md") + "/"
        assert source.startswith(f'<a href="{page_url}">{heading}</a>'), (question, source)


def test_the_site_ships_an_anki_deck_with_one_card_per_question(built_site: Path, tmp_path: Path) -> None:
    notes = _deck_notes(built_site / handbook.DECK_PATH, tmp_path)
    bank = handbook.question_bank()
    assert len(notes) == len(bank)
    by_question = _by_question(notes)
    for card in bank:
        question, answer, source = by_question[card["question"].replace("`", "")]
        assert answer.strip()
        for test in card["tests"]:
            assert test in source, f"the card for {card['question']!r} must link {test}"
    page = (built_site / "interview" / "hard-questions" / "index.html").read_text(encoding="utf-8")
    assert 'href="../hard-questions.apkg"' in page


def test_deck_links_use_the_published_address_never_the_local_server(tmp_path: Path) -> None:
    """A card carried to a phone must open its page: the loopback address `mkdocs serve`
    uses is replaced by the repository's Pages address, or by the page's name."""
    repo = "https://github.com/Example-Org/handbook"
    assert handbook.published_url("https://handbook.example/docs", repo) == "https://handbook.example/docs/"
    for local in ("http://127.0.0.1:8000/", "http://localhost:8000/", None):
        assert handbook.published_url(local, repo) == "https://example-org.github.io/handbook/"
        assert handbook.published_url(local, None) is None
    handbook.build_deck(tmp_path / "pages.apkg", "http://127.0.0.1:8000/", repo)
    handbook.build_deck(tmp_path / "named.apkg", "http://127.0.0.1:8000/", None)
    pages = [note[2] for note in _deck_notes(tmp_path / "pages.apkg", tmp_path / "a")]
    named = [note[2] for note in _deck_notes(tmp_path / "named.apkg", tmp_path / "b")]
    assert all('href="https://example-org.github.io/handbook/' in source for source in pages)
    assert all("127.0.0.1" not in source and "<code>" in source for source in named)
