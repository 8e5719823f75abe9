"""MkDocs hooks: the interview notebook built from the tested module, and install lines.

* `<!-- notebook-links -->` on a page becomes a download link to the notebook generated at
  build time from `reference_impl/notebook.py` (each `--8<--` section is one cell), and an
  "Open in Colab" link when the site knows its repository (`repo_url`).
* `<!-- package-install -->` becomes the one line that installs the package, for pages
  whose excerpts call into the rest of it.
* `<!-- self-test -->` on a hard-questions page becomes a link to the Anki deck built from
  every hard question (general and biotech), each card linking the test that proves it.
* The all-in-one page inlines the other pages with their headings one level down, so its
  table of contents lists every page and section. It shows the notebook's cells once each
  and names every other package section instead of repeating its code.

Run as a script to refresh the committed copy that Colab opens from the repository:

    python docs/hooks/handbook.py
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from pathlib import Path
from urllib.parse import urlparse
from typing import Any

from facts import expand  # docs/hooks/facts.py: MkDocs puts a hook's folder on the path
from mkdocs.utils.meta import get_data

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "reference_impl" / "notebook.py"
COMMITTED = ROOT / "notebooks" / "interview_trainer.ipynb"  # what Colab opens
SITE_PATH = "practice/interview_trainer.ipynb"  # what the download link serves
NOTEBOOK_MARK = "<!-- notebook-links -->"
INSTALL_MARK = "<!-- package-install -->"
SECTION = re.compile(r"^# --8<-- \[start:(?P<name>\w+)\]\n(?P<body>.*?)^# --8<-- \[end:(?P=name)\]\n",
                     re.S | re.M)
MARKER_LINE = re.compile(r"^# --8<-- \[(start|end):\w+\]\n", re.M)
ALL_IN_ONE = "reference/all-in-one.md"
HEADERLINK = re.compile(r'<a class="headerlink" href="#[^"]*" title="Permanent link">[^<]*</a>')
LISTING = re.compile(r"(<pre><span></span>)<code>")  # a Pygments listing, as pymdownx.highlight writes it
# Pygments' spans for names and whitespace: the theme colours a name as the listing's own
# text (`--md-code-hl-name-color` is `--md-code-fg-color` in both palettes) and whitespace
# not at all, so a listing looks the same without them (the parallelism playbook: 9,875 elements
# become 7,088).
PLAIN_TOKEN = re.compile(r'<span class="[nw]">([^<]*)</span>')
TABLE_MARK = re.compile(r"<!-- table: (?P<name>[a-z0-9_]+) -->")  # expanded by docs/hooks/tables.py
SELF_TEST_MARK = "<!-- self-test -->"
QUESTION_PAGES = ("interview/hard-questions.md", "biotech/hard-questions.md")
DECK_PATH = "interview/hard-questions.apkg"
QUESTION = re.compile(r'^\?\?\? question "(?P<question>.+)"\n(?P<body>(?:(?: {4}.*)?\n)+)', re.M)
# A question's "How we know" fold: its title line and every line after it that is blank or indented.
PROOF_FOLD = re.compile(r'^\?\?\?\+? proof "How we know"\n(?:(?:[ \t]+.*)?\n)*', re.M)
TEST_REF = re.compile(r"`(?P<file>tests/[\w./-]+\.py)::(?P<name>[\w:]+)(?:\[[^\]`]*\])?`")
PAGE_INCLUDE = re.compile(r'^--8<-- "(?P<path>docs/[^"]+\.md)"$', re.M)
FENCE = re.compile(r"^(?P<indent>\s*)(?P<mark>```|~~~)")
NOTEBOOK_SECTION = "reference_impl/notebook.py:"
CODE_INCLUDE = re.compile(r'^\s*--8<-- "(?P<target>[^"]+)"\s*$')

INTRO = """# The interview trainer

A data-parallel trainer in the cells you would type in an interview: config, rank wiring,
data, the resumable sampler, model and DDP, the train step, phase timing, an atomic
checkpoint, and the resume loop. It needs only `torch` and `numpy`, runs on a CPU in
seconds, and is the file `reference_impl/notebook.py` of the handbook's repository, whose
tests prove that it trains exactly like the full package (same loss at every step, same
final `state_digest`). Run the cells top to bottom; run them again and the second run
starts afresh in a new checkpoint directory."""

TWO_RANKS = """## Two ranks from this notebook

`torchrun` starts one process per rank from a file, so the first cell writes this
notebook's code to `interview_trainer.py` and runs it on two CPU ranks (gloo). The
second runs the same job without a shell, by forking two processes that inherit the
functions defined above (a spawned process could not import them: they live in no
module). Both print the same final `state_digest`: one job, launched two ways. In between,
the same job runs again with rank 1 SIGKILLed at step 15, five steps after a checkpoint:
torchrun restarts both ranks, they restore step 10 and end with the same digest. The
surviving rank's gloo traceback (`Connection reset by peer`) in that cell's output is expected:
it is rank 0 seeing its peer die. On a GPU
runtime, prefer the file: once CUDA is initialised in this kernel, a forked child cannot use it."""

TORCHRUN_CELL = """lines = !{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 interview_trainer.py --max-steps 20
from_torchrun = json.loads([line for line in lines if '"run_complete"' in line][-1])
print(from_torchrun)"""

KILL_CELL = """import tempfile
kill_dir = tempfile.mkdtemp()  # a fresh directory: the restart must find the checkpoint of THIS job
lines = !{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 interview_trainer.py --max-steps 20 --checkpoint-every 10 --checkpoint-dir {kill_dir} --fail-at-step 15 --fail-rank 1
events = [json.loads(line) for line in lines if line.startswith('{"event"')]
restored = [e["step"] for e in events if e["event"] == "checkpoint_restored"]
assert restored == [10], f"restored {restored}: the kill at step 15 must come after the checkpoint at step 10"
assert events[-1]["state_digest"] == from_torchrun["state_digest"], "killed and restarted, the job ends where it would have"
print(events[-1])"""

LAUNCH_CELL = """from_launch = launch(2, ["--max-steps", "20"])
assert from_launch["state_digest"] == from_torchrun["state_digest"], "one job, two launchers"
print(from_launch)"""


def _heading(body: str) -> str:
    """'# Cell 3: data that ... seed.' -> '## Cell 3: data that ... seed'."""
    first = body.splitlines()[0].removeprefix("# ").strip()
    return "## " + first.split(". ")[0].rstrip(".")


def build_notebook(source: str | None = None) -> dict[str, Any]:
    """The .ipynb (nbformat 4.5) of the interview trainer: one code cell per section."""
    source = SOURCE.read_text(encoding="utf-8") if source is None else source
    cells: list[dict[str, Any]] = [_markdown(INTRO)]
    for m in SECTION.finditer(source):
        cells += [_markdown(_heading(m["body"])), _code(m["body"].rstrip("\n"))]
    script = MARKER_LINE.sub("", source).rstrip("\n")
    cells += [_markdown(TWO_RANKS), _code("%%writefile interview_trainer.py\n" + script),
              _code(TORCHRUN_CELL), _code(KILL_CELL), _code(LAUNCH_CELL)]
    for index, cell in enumerate(cells):
        cell["id"] = f"cell-{index:02d}"
    return {"cells": cells, "nbformat": 4, "nbformat_minor": 5, "metadata": {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"}}}


def notebook_json(source: str | None = None) -> str:
    return json.dumps(build_notebook(source), indent=1, ensure_ascii=False) + "\n"


def _markdown(text: str) -> dict[str, Any]:
    return {"cell_type": "markdown", "metadata": {}, "source": text.splitlines(keepends=True)}


def _code(text: str) -> dict[str, Any]:
    return {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
            "source": text.splitlines(keepends=True)}


def colab_url(repo_url: str | None) -> str | None:
    """Colab opens notebooks from GitHub: the committed copy on the main branch."""
    m = re.match(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?$", repo_url or "")
    if not m:
        return None
    return (f"https://colab.research.google.com/github/{m[1]}/{m[2]}/blob/main/"
            f"{COMMITTED.relative_to(ROOT).as_posix()}")


def published_url(site_url: str | None, repo_url: str | None) -> str | None:
    """The address the handbook is read at, for links that leave the site (the Anki deck).

    `site_url` when it names a real host; a local default (`mkdocs serve`'s loopback
    address) does not, since a card carried to another device cannot reach it. Then the
    GitHub Pages address of `repo_url`, which is where the Pages workflow publishes; else
    None, and links name the page instead.
    """
    host = urlparse(site_url or "").hostname or ""
    if host and host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return site_url.rstrip("/") + "/"  # type: ignore[union-attr]
    m = re.match(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?$", repo_url or "")
    return f"https://{m[1].lower()}.github.io/{m[2]}/" if m else None


def install_command(repo_url: str | None) -> str:
    if repo_url:
        return f'pip install "git+{repo_url.rstrip("/")}"'
    return "pip install -e .   # in a clone of this repository"


def assemble_all_in_one(markdown: str) -> str:
    """Inline every `--8<-- "docs/x.md"` page, headings demoted, repeated code blocks linked."""
    shown: set[str] = set()
    return PAGE_INCLUDE.sub(
        lambda m: _name_tables(_plain_code(_show_code_once(_demote_headings(
            _body((ROOT / m["path"]).read_text(encoding="utf-8"))), shown)), m["path"]), markdown)


def _body(page: str) -> str:
    """A page without its front matter (its search boost is its own page's, not this one's)."""
    return get_data(page)[0]


def _name_tables(text: str, path: str) -> str:
    """Point at a page's computed data tables instead of repeating them: they are measured
    grids, rows of numbers to look up, not text to read in a final pass."""
    link = posixpath.relpath(path.removeprefix("docs/"), posixpath.dirname(ALL_IN_ONE))
    return TABLE_MARK.sub(lambda t: f"*The computed table `{t['name']}` is on [its page]({link}).*", text)


def _plain_code(text: str) -> str:
    """Code without syntax colouring: token-by-token highlighting would triple the page's size."""
    return re.sub(r"^(\s*(?:```|~~~))(?:python|bash|sh|console|yaml|json)\b", r"\1text", text, flags=re.M)


def _demote_headings(text: str) -> str:
    out, fence = [], None
    for line in text.splitlines():
        if m := FENCE.match(line):
            fence = None if fence == m["mark"] else fence or m["mark"]
        elif fence is None and re.match(r"#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out) + "\n"


def _show_code_once(text: str, shown: set[str]) -> str:
    """Show the notebook's cells once each; name every other package section in one line."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        end = next((j for j in range(i + 1, len(lines)) if m and lines[j].strip() == m["mark"]), None)
        if not end:
            out.append(lines[i])
            i += 1
            continue
        body = [line for line in lines[i + 1:end] if line.strip()]
        includes = [CODE_INCLUDE.match(line) for line in body]
        if body and all(includes):  # a fence of package sections only
            fresh = [line for line, inc in zip(body, includes) if inc["target"] not in shown]
            shown.update(inc["target"] for inc in includes)
            names = ", ".join(f"`{inc['target']}`" for inc in includes if not inc["target"].endswith(":imports"))
            if not all(inc["target"].startswith(NOTEBOOK_SECTION) for inc in includes):
                # Package sections stay on their own pages; the notebook's cells are shown here.
                out.append(f"{m['indent']}*Code: {names}, shown on the section's own page.*")
            elif fresh:
                out += [lines[i], *fresh, lines[end]]
            else:
                out.append(f"{m['indent']}*The code of {names} is shown earlier on this page.*")
        else:
            out += lines[i:end + 1]
        i = end + 1
    return "\n".join(out) + "\n"


def question_bank() -> list[dict[str, Any]]:
    """Every hard question with its answer (Markdown), topic, page and the tests it cites."""
    bank = []
    for page in QUESTION_PAGES:
        text = expand((ROOT / "docs" / page).read_text(encoding="utf-8"))  # a card shows facts, not placeholders
        for m in QUESTION.finditer(text):
            topics = re.findall(r"^## (.+)$", text[:m.start()], re.M)
            body = "\n".join(line[4:] for line in m["body"].splitlines()).strip()
            # The answer a card shows is the question's text without its "How we know" fold;
            # the tests that fold names become the card's proof links.
            answer = PROOF_FOLD.sub("", body + "\n").strip()
            bank.append({"question": m["question"], "answer": answer, "page": page,
                         "topic": topics[-1] if topics else "",
                         "tests": [f"{t['file']}::{t['name']}" for t in TEST_REF.finditer(body)]})
    return bank


def build_deck(path: Path, site_url: str | None, repo_url: str | None) -> int:
    """Write the Anki deck of the question bank to `path`; return its number of cards.

    Each card links its page at the published address (`published_url`); without one it
    names the page, rather than link an address only the build machine can open.
    """
    import genanki
    import markdown as md

    model = genanki.Model(
        1_640_217_001, "Distributed training handbook: question",
        fields=[{"name": "Question"}, {"name": "Answer"}, {"name": "Source"}],
        templates=[{"name": "Card", "qfmt": "{{Question}}",
                    "afmt": "{{FrontSide}}<hr id=answer>{{Answer}}<p><small>{{Source}}</small></p>"}])
    deck = genanki.Deck(1_640_217_002, "Distributed training interview handbook")
    blob = f"{repo_url.rstrip('/')}/blob/main/" if repo_url else None
    published = published_url(site_url, repo_url)
    for card in question_bank():
        answer = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", card["answer"])  # page links do not work in Anki
        proofs = [f'<a href="{blob}{t.split("::")[0]}">{t}</a>' if blob else f"<code>{t}</code>"
                  for t in card["tests"]]
        topic = card["topic"] or "handbook"
        if published:
            source = f'<a href="{published}{card["page"].removesuffix(".md")}/">{topic}</a>'
        else:
            source = f'{topic} (<code>{card["page"]}</code> in the handbook)'
        if proofs:
            source += "; proved by " + ", ".join(proofs)
        deck.add_note(genanki.Note(model=model, guid=genanki.guid_for(card["question"]), tags=[
            card["page"].split("/")[0]], fields=[md.markdown(card["question"]),
                                                 md.markdown(answer, extensions=["tables"]), source]))
    path.parent.mkdir(parents=True, exist_ok=True)
    genanki.Package(deck).write_to_file(str(path))
    return len(deck.notes)


def on_page_markdown(markdown: str, page: Any, config: Any, **_: Any) -> str:
    """Expand the two markers on any page that has them (the all-in-one page included)."""
    repo_url = config.get("repo_url")
    if page.file.src_uri == ALL_IN_ONE:
        markdown = assemble_all_in_one(markdown)
    if NOTEBOOK_MARK in markdown:
        # Directory URLs (a/b/) are folders; file URLs (a/b.html) live in their parent.
        base = page.url if page.url.endswith("/") else posixpath.dirname(page.url)
        link = posixpath.relpath(SITE_PATH, base.rstrip("/") or ".")
        colab = colab_url(repo_url)
        colab_html = (f'<a class="md-button" href="{colab}">Open in Colab</a>' if colab else
                      '<em>(an "Open in Colab" link appears when the site is built with its repository address)</em>')
        markdown = markdown.replace(NOTEBOOK_MARK, (
            f'<p class="handbook-notebook"><a class="md-button md-button--primary" href="{link}" '
            f'download>Download the notebook (.ipynb)</a> {colab_html}</p>'))
    if SELF_TEST_MARK in markdown:
        base = page.url if page.url.endswith("/") else posixpath.dirname(page.url)
        link = posixpath.relpath(DECK_PATH, base.rstrip("/") or ".")
        cards = len(question_bank())
        markdown = markdown.replace(SELF_TEST_MARK, (
            "**Self-test.** Each answer stays folded until you open it. After reading one, mark it "
            "*Knew it* or *Review again*; this browser remembers your marks, and *Hide known* "
            f'leaves only what still needs work. The same {cards} questions, general and biotech, '
            f'are also an <a href="{link}" download>Anki deck</a>, each card linking the test '
            "that proves its answer."))
    if INSTALL_MARK in markdown:  # once per page, however many included pages asked for it
        head, _, tail = markdown.partition(INSTALL_MARK)
        markdown = head + INSTALL_MARK + tail.replace(INSTALL_MARK, "")
        markdown = markdown.replace(INSTALL_MARK, (
            '<div class="handbook-install" markdown>\n\n'
            "**Package excerpts.** A code block titled with a `reference_impl/...` path is a section "
            "of that tested module and calls into the rest of it. To run one outside a clone, "
            f"install the package first (it needs torch and numpy): `{install_command(repo_url)}`\n\n"
            "</div>"))
    return markdown


def on_page_content(html: str, page: Any, **_: Any) -> str:
    """Every highlighted listing is a keyboard stop, and the all-in-one page drops its 150
    headings' permanent links (a tenth of its weight on a phone): the sections it inlines
    have their own pages, where the permanent links are.

    A listing wider than the screen scrolls, and only a focusable one scrolls from the
    keyboard. The theme adds the stop when it measures a listing, but it measures each one
    only once it comes near the viewport (`content.lazy` in mkdocs.yml: measuring all of them
    at load forced a layout of the whole page per listing); until then the stop comes from
    here, and the theme removes it from a listing that turns out not to scroll.

    Names and whitespace lose their token spans (PLAIN_TOKEN): most of a long page's
    elements were token spans, each one style and layout work on a phone.
    """
    html = PLAIN_TOKEN.sub(r"\1", LISTING.sub(r'\1<code tabindex="0">', html))
    return HEADERLINK.sub("", html) if page.file.src_uri == ALL_IN_ONE else html


def on_page_context(context: dict[str, Any], page: Any, **_: Any) -> dict[str, Any]:
    """The all-in-one page's table of contents lists the pages it holds, not their 130
    sections: each page's own table of contents has those, and on this page they would be
    a sixth of its weight."""
    if page.file.src_uri == ALL_IN_ONE:
        for top in page.toc.items:
            for inlined in top.children:
                inlined.children = []
    return context


def on_post_build(config: Any, **_: Any) -> None:
    """Write the notebook (freshly generated from the module) and the Anki deck into the site."""
    target = Path(config["site_dir"]) / SITE_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(notebook_json(), encoding="utf-8")
    build_deck(Path(config["site_dir"]) / DECK_PATH, config["site_url"], config.get("repo_url"))


if __name__ == "__main__":
    COMMITTED.parent.mkdir(parents=True, exist_ok=True)
    COMMITTED.write_text(notebook_json(), encoding="utf-8")
    print(f"wrote {COMMITTED.relative_to(ROOT)}", file=sys.stderr)
