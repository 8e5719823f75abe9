"""MkDocs hook: a fact that pages state has one source, and pages say it as `{{ fact.NAME }}`.

`{{ fact.NAME }}` on a page becomes the value of `FACTS[NAME]`, read at build time from
where the fact lives: the package's code (cell and line counts, the checksum algorithm, the
parallelisms and mesh axes, flags' choices), the committed benchmark runs
(`docs/data/*.json`), the pages that number a series (drills, pitfalls), and, for the few
facts no code knows, `docs/hooks/facts.json`. `{{ fact.NAME:word }}` writes a count of
twelve or less as a word, `:Word` capitalised, for a sentence's start. An unknown name, or
anything shaped like a placeholder that is not one, stops the build with a `ValueError`
that names the page and lists the known names; so does a placeholder left in a page's HTML
(a Markdown file included by a snippet after this hook ran).

`STATED` lists the shapes in which pages state each fact in words; a group named after a
fact captures the value a page gives. `tests/docs/test_docs_one_voice.py` finds every such
statement on the expanded pages and the README and fails when one differs from the source,
so a literal typed where the placeholder belongs, or kept in a heading, a link or the README
(which GitHub shows unexpanded), cannot drift unnoticed.

Placeholders are expanded everywhere in a page's Markdown, inline code included; code that
snippets include from `reference_impl/` arrives later and is never touched, so its braces
stay as they are. This hook runs after `handbook.py`, so the all-in-one page's inlined
pages are expanded too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data"
KNOWN_ELSEWHERE = Path(__file__).with_name("facts.json")  # facts no code or data file holds
# `:word` rather than a Jinja-like `| word`: a pipe would split a Markdown table's cell.
PLACEHOLDER = re.compile(r"\{\{\s*fact\.(?P<name>[a-z0-9_]+)(?::(?P<form>word|Word))?\s*\}\}")
# Anything a writer may have meant as a placeholder: a misspelt one must fail, not show.
LOOKS_LIKE = re.compile(r"\{\{\s*facts?\b[^}]*\}\}")
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve")
# How the pages name each parallelism of `reference_impl.parallel.PARALLELISMS`, in reading order.
PARALLELISM_NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "tp": "tensor", "pp": "pipeline", "cp": "context",
                     "ep": "expert"}

Value = int | str


def _sections(module: str) -> int:
    """Snippet sections of a module: the cells of a notebook made from it."""
    text = (ROOT / "reference_impl" / module).read_text(encoding="utf-8")
    return len(re.findall(r"^# --8<-- \[start:", text, re.M))


def _lines(module: str) -> int:
    return len((ROOT / "reference_impl" / module).read_text(encoding="utf-8").splitlines())


def _numbered(pattern: str, *pages: str) -> int:
    """How many numbered headings (`## Drill 7:`, `## 7. `) the pages of a series hold."""
    return sum(len(re.findall(pattern, (ROOT / "docs" / page).read_text(encoding="utf-8"), re.M))
               for page in pages)


def _checksum() -> str:
    from reference_impl.checkpoint import integrity

    return integrity.ALGORITHM.upper().replace("_", "-")  # xxh3_128 -> XXH3-128


def _calculators() -> int:
    """The calculators the browser exports (`window.handbookCalc`), each a `reference_impl.calc` twin."""
    script = (ROOT / "docs" / "javascripts" / "calculators.js").read_text(encoding="utf-8")
    body = re.search(r"window\.handbookCalc = \{(?P<body>[^}]*)\}", script, re.S)
    if body is None:
        raise ValueError("calculators.js no longer assigns window.handbookCalc = {...}")
    return len(re.findall(r"\w+\s*:", body["body"]))


def _parallelisms() -> str:
    from reference_impl.parallel import PARALLELISMS

    if set(PARALLELISMS) != set(PARALLELISM_NAMES):
        raise ValueError(f"name each parallelism in PARALLELISM_NAMES (registry: {', '.join(PARALLELISMS)})")
    names = list(PARALLELISM_NAMES.values())
    return f"{', '.join(names[:-1])} and {names[-1]} parallel"


def _mesh_axes() -> str:
    from reference_impl.mesh import AXES

    return ", ".join(AXES)


def _choices(field: str) -> Callable[[], str]:
    def choices() -> str:
        from reference_impl.config import TrainConfig
        from reference_impl.options.base import choices_of

        values = choices_of(TrainConfig, field)
        if not values:
            raise ValueError(f"TrainConfig.{field} has no choices")
        return f"--{field.replace('_', '-')} {'|'.join(values)}"
    return choices


def _record(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def _gpt2_step(index: int) -> dict[str, Any]:
    """One run of the GPT-2-small ladder (`docs/data/gpu_small.json`): eager, blocks compiled,
    loss compiled too, then more sequences per step."""
    return _record("gpu_small")["data"]["steps"][index]["result"]


def _gpt2_best() -> dict[str, Any]:
    return max((s["result"] for s in _record("gpu_small")["data"]["steps"]), key=lambda r: r["ddp"]["mfu"])


def _tokens(result: dict[str, Any]) -> str:
    return f"{result['ddp']['tokens_per_s']:,.0f}"


def _fp8_largest() -> dict[str, Any]:
    return max(_record("gpu_fp8")["data"]["cases"], key=lambda c: c["k"])


def _matmul_ceiling() -> str:
    """TFLOP/s of the largest bf16 matmul of `bench fp8` (2·K³ FLOPs in its measured time)."""
    case = _fp8_largest()
    return f"{2 * case['k'] ** 3 / (case['ms']['matmul bf16'] / 1e3) / 1e12:.0f}"


def _known_elsewhere(name: str) -> Callable[[], Value]:
    def value() -> Value:
        return json.loads(KNOWN_ELSEWHERE.read_text(encoding="utf-8"))[name]["value"]
    return value


FACTS: dict[str, Callable[[], Value]] = {
    # Counts the code and the pages' own series hold.
    "walkthrough_cells": lambda: _sections("notebook.py"),
    "core_cells": lambda: _sections("interview_core.py"),
    "core_lines": lambda: _lines("interview_core.py"),
    "drills": lambda: _numbered(r"^## Drill \d+:", "practice/timed-drills.md",
                                "practice/timed-drills-checkpoint.md", "practice/timed-drills-resume.md"),
    "pitfalls": lambda: _numbered(r"^## \d+\. ", "practice/pitfalls.md", "practice/pitfalls-training-step.md"),
    "calculators": _calculators,
    # Names the code defines.
    "manifest_checksum": _checksum,
    "parallelisms": _parallelisms,
    "mesh_axes": _mesh_axes,
    "flag_precision": _choices("precision"),
    "flag_pp_schedule": _choices("pp_schedule"),
    "flag_nonfinite_policy": _choices("nonfinite_policy"),
    # Measured: the committed benchmark runs.
    "gpt2_eager_tokens_per_s": lambda: _tokens(_gpt2_step(0)),
    "gpt2_blocks_compiled_tokens_per_s": lambda: _tokens(_gpt2_step(1)),
    "gpt2_loss_compiled_tokens_per_s": lambda: _tokens(_gpt2_step(2)),
    "gpt2_loss_eager_peak_gib": lambda: f"{_gpt2_step(1)['ddp']['peak_memory_gib']:.2f}",
    "gpt2_loss_compiled_peak_gib": lambda: f"{_gpt2_step(2)['ddp']['peak_memory_gib']:.2f}",
    "gpt2_best_mfu": lambda: f"{_gpt2_best()['ddp']['mfu']:.1%}",
    "gpt2_best_sequences": lambda: _gpt2_best()["global_batch_size"],
    "bench_model_eager_mfu": lambda: f"{_record('gpu')['data']['runs']['eager']['ddp']['mfu']:.1%}",
    "matmul_ceiling_tflops": _matmul_ceiling,
    "fp8_matmul_speedup_largest": lambda: f"{_fp8_largest()['matmul_speedup']:.2f}x",
    "fp8_compiled_speedup_largest": lambda: f"{_fp8_largest()['layer_speedup_compiled']:.2f}x",
    # What no code knows: the interview's clock.
    "interview_minutes": _known_elsewhere("interview_minutes"),
    "core_minutes": _known_elsewhere("core_minutes"),
}

# The shapes in which pages state a fact in words: a group named after a fact captures the
# value a page gives (one group per fact in a shape; another wording is another shape). A count
# may be written in digits or as a word; `(?i)` where a sentence may start with the statement.
NUMBER = r"\d[\d,]*|" + "|".join(WORDS[1:])
STATED: tuple[str, ...] = (
    rf"(?i)full trainer in (?P<walkthrough_cells>{NUMBER}) cells",
    rf"its (?P<walkthrough_cells>{NUMBER}) cells, then the cells that run it",
    rf"interview core in (?P<core_cells>{NUMBER}) cells",
    rf"(?i)(?:type all|shows it as) (?P<core_cells>{NUMBER}) cells",
    rf"(?P<core_cells>{NUMBER}) cells, \d+ lines of torch",
    rf"(?<!at most )(?P<core_lines>{NUMBER})\s+lines of torch",
    rf"- (?P<core_lines>{NUMBER}) lines, the standard library and torch only",
    rf"(?i)\b(?P<drills>{NUMBER}) (?:timed )?drills\b",
    rf"(?i)\b(?P<pitfalls>{NUMBER}) (?:pitfalls|tempting mistakes|mistakes that look reasonable)\b",
    rf"(?i)all (?P<calculators>{NUMBER}) of the handbook's calculators",
    r"manifest of checksums \((?P<manifest_checksum>[^)]+)\)",
    r"every file with its checksum \((?P<manifest_checksum>[^;)]+)",
    r"manifest of (?P<manifest_checksum>[\w-]+) checksums",
    r"checksums every byte \((?P<manifest_checksum>[^,)]+)",
    r"\b(?P<manifest_checksum>XXH3-\d+)\b",
    r"(?P<parallelisms>DDP(?:, FSDP2| and FSDP2)[^()]*? parallel)\b",
    r"registry of parallelisms \((?P<parallelisms>[^)]*)\)",
    r"mesh with named axes \((?P<mesh_axes>[^)]*)\)",
    r"(?P<flag_precision>--precision (?:[\w-]+\|)+[\w-]+)",
    r"(?P<flag_pp_schedule>--pp-schedule\s+(?:[\w-]+\|)+[\w-]+)",
    r"(?P<flag_nonfinite_policy>--nonfinite-policy (?:[\w-]+\|)+[\w-]+)",
    r"blocks alone gave \+\d+%\*\* \((?P<gpt2_eager_tokens_per_s>[\d,]+) → "
    r"(?P<gpt2_blocks_compiled_tokens_per_s>[\d,]+)",
    r"largest single gain: (?P<gpt2_blocks_compiled_tokens_per_s>[\d,]+) → (?P<gpt2_loss_compiled_tokens_per_s>[\d,]+)",
    r"compiled run from (?P<gpt2_blocks_compiled_tokens_per_s>[\d,]+) to (?P<gpt2_loss_compiled_tokens_per_s>[\d,]+)",
    r"compiled took DDP from (?P<gpt2_eager_tokens_per_s>[\d,]+) to (?P<gpt2_loss_compiled_tokens_per_s>[\d,]+)",
    r"peak(?: memory)? from (?P<gpt2_loss_eager_peak_gib>[\d.]+) to\s+(?P<gpt2_loss_compiled_peak_gib>[\d.]+) GiB",
    r"(?P<gpt2_best_mfu>\d+\.\d%)\*{0,2} at (?P<gpt2_best_sequences>\d+)(?: sequences|: )",
    r"(?i)eager: (?P<bench_model_eager_mfu>\d+\.\d%) MFU",
    r"\[(?P<bench_model_eager_mfu>\d+\.\d%) MFU\]\(",
    r"(?P<matmul_ceiling_tflops>\d+) TFLOP/s(?:,| matmul ceiling| the largest bf16 matmul|, not 989| is read)",
    r"(?P<fp8_matmul_speedup_largest>\d+\.\d+x) at 8,192(?:, where|;|\.)",
    r"(?P<fp8_compiled_speedup_largest>\d+\.\d+x) at 8,192\)",
    r"by (?P<fp8_compiled_speedup_largest>\d+\.\d+x) at 8,192",
    r"(?i)(?P<interview_minutes>\d+)-minute\s+\[?(?:plan|interview|time plan)",
    r"(?i)time[ -]plan[ -]for[ -](?P<interview_minutes>\d+)[ -]minutes",  # the heading, and links to it
    r"types in (?P<interview_minutes>\d+) minutes",
    r"lines of torch,? (?:you can type in )?(?P<core_minutes>\d+)\s+minutes",
    r"and 30–(?P<core_minutes>\d+)\.",
)


def fact(name: str) -> Value:
    """The value of a registered fact.

    Raises:
        ValueError: No fact has that name.
    """
    if name not in FACTS:
        raise ValueError(f"{{{{ fact.{name} }}}}: no such fact (known: {', '.join(FACTS)})")
    return FACTS[name]()


def render(name: str, form: str | None = None) -> str:
    """The text a placeholder becomes: a count with thousands separators, or as a word."""
    value = fact(name)
    if form:
        if not isinstance(value, int) or not 0 <= value < len(WORDS):
            raise ValueError(f"{{{{ fact.{name}:{form} }}}}: {value!r} is no count of twelve or less")
        word = WORDS[value]
        return word.capitalize() if form == "Word" else word
    return f"{value:,}" if isinstance(value, int) else value


def _expanded(match: re.Match[str]) -> str:
    exact = PLACEHOLDER.fullmatch(match[0])
    if exact is None:
        raise ValueError(f"{match[0]}: not a placeholder; write {{{{ fact.NAME }}}} (known: {', '.join(FACTS)})")
    return render(exact["name"], exact["form"])


def expand(markdown: str) -> str:
    """`markdown` with every `{{ fact.NAME }}` replaced by its value."""
    return LOOKS_LIKE.sub(_expanded, markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace each placeholder with its fact; a bad one stops the build, naming the page."""
    try:
        return expand(markdown)
    except ValueError as exc:
        raise ValueError(f"{page.file.src_uri}: {exc}") from None


def on_page_content(html: str, page: Any, **_: Any) -> str:
    """Stop the build on a placeholder that reached the HTML unexpanded."""
    if m := LOOKS_LIKE.search(html):
        raise ValueError(f"{page.file.src_uri}: {m[0]} was not expanded (a snippet-included Markdown file?)")
    return html
