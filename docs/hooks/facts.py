"""MkDocs hook: a fact that pages state has one source, and pages say it as `{{ fact.NAME }}`.

`{{ fact.NAME }}` on a page becomes the value of `FACTS[NAME]`, read at build time from
where the fact lives: the package's code (cell and line counts, the checksum algorithm, the
parallelisms and mesh axes, flags' choices), the committed benchmark runs
(`docs/data/*.json`), the calculators (a worked checkpoint interval), the pages that number
a series (drills, pitfalls), and, for the few facts no code knows, `docs/hooks/facts.json`.
`{{ fact.NAME:word }}` writes a count of twelve or less as a word, `:Word` capitalised, for a
sentence's start. An unknown name, or
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
from functools import partial
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
# How the pages name each parallelism of `reference_impl.parallel.registry.PARALLELISMS`, in
# reading order; ring and Ulysses attention are two styles of one: context parallel.
PARALLELISM_NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "tp": "tensor", "pp": "pipeline", "cp": "context",
                     "ulysses": "context", "ep": "expert"}

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
    from reference_impl.parallel.registry import PARALLELISMS

    if set(PARALLELISMS) != set(PARALLELISM_NAMES):
        raise ValueError(f"name each parallelism in PARALLELISM_NAMES (registry: {', '.join(PARALLELISMS)})")
    names = list(dict.fromkeys(PARALLELISM_NAMES.values()))
    return f"{', '.join(names[:-1])} and {names[-1]} parallel"


def _mesh_axes() -> str:
    from reference_impl.parallel.mesh import AXES

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


def _known(name: str) -> Value:
    """A fact from `facts.json`, where each one is `{"value": ..., "why": ...}`.

    Raises:
        ValueError: The file has no whole number or text for that name.
    """
    entry = json.loads(KNOWN_ELSEWHERE.read_text(encoding="utf-8")).get(name)
    value = entry.get("value") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{KNOWN_ELSEWHERE.name}: {name!r} has no value (a whole number or text)")
    return value


def _known_count(name: str) -> int:
    value = _known(name)
    if not isinstance(value, int):
        raise ValueError(f"{KNOWN_ELSEWHERE.name}: {name!r} must be a whole number (got {value!r})")
    return value


def _llama3_mtbf_h() -> float:
    """Llama 3's job MTBF in hours: the reported period over its unexpected interruptions."""
    return _known_count("llama3_days") * 24 / _known_count("llama3_unexpected_interruptions")


def _young(save: str) -> dict[str, float]:
    """`calc.checkpoint_interval` at Llama 3's job MTBF for one of the worked example's save times."""
    from reference_impl import calc

    return calc.checkpoint_interval(checkpoint_cost_s=_known_count(save), mtbf_s=_llama3_mtbf_h() * 3600)


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
    # Young's checkpoint interval at Llama 3's failure rate, worked by `calc.checkpoint_interval`.
    "llama3_job_mtbf_h": lambda: f"{_llama3_mtbf_h():.2f}",
    "young_minutes": lambda: f"{_young('worked_save_s')['young_interval_s'] / 60:.1f}",
    "young_overhead": lambda: f"{_young('worked_save_s')['young_overhead_fraction']:.1%}",
    "async_young_minutes": lambda: f"{_young('worked_async_save_s')['young_interval_s'] / 60:.1f}",
    "async_young_overhead": lambda: f"{_young('worked_async_save_s')['young_overhead_fraction']:.1%}",
    # What no code knows: the interview's clock, a published failure count, assumed save times.
    **{name: partial(_known, name) for name in ("interview_minutes", "core_minutes", "llama3_unexpected_interruptions",
                                                "llama3_days", "worked_save_s", "worked_async_save_s")},
}

# The shapes in which pages state a fact in words: a group named after a fact captures the
# value a page gives (one group per fact in a shape; another wording is another shape). A count
# may be written in digits or as a word; `(?i)` where a sentence may start with the statement.
# A space outside a character class matches any run of whitespace, a line break and the next
# line's indent included, as Markdown reads a paragraph (`shapes()` compiles them so).
NUMBER = r"\d[\d,]*|" + "|".join(WORDS[1:])
STATED: tuple[str, ...] = (
    rf"(?i)full trainer in (?P<walkthrough_cells>{NUMBER}) cells",
    rf"its (?P<walkthrough_cells>{NUMBER}) cells, then the cells that run it",
    rf"interview core in (?P<core_cells>{NUMBER}) cells",
    rf"(?i)(?:type all|shows it as) (?P<core_cells>{NUMBER}) cells",
    rf"(?P<core_cells>{NUMBER}) cells, \d+ lines of torch",
    rf"(?P<core_lines>{NUMBER}) lines of torch",  # not "at most 150 lines", the core's limit
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
    r"from K = 4,096 \((?P<fp8_compiled_speedup_largest>\d+\.\d+x) at 8,192\)",
    r"by (?P<fp8_compiled_speedup_largest>\d+\.\d+x) at 8,192",
    r"(?i)(?P<interview_minutes>\d+)-minute\s+\[?(?:plan|interview|time plan)",
    r"(?i)time[ -]plan[ -]for[ -](?P<interview_minutes>\d+)[ -]minutes",  # the heading, and links to it
    r"types in (?P<interview_minutes>\d+) minutes",
    r"lines of torch,? (?:you can type in )?(?P<core_minutes>\d+)\s+minutes",
    r"and 30–(?P<core_minutes>\d+)\.",
    r"(?P<llama3_unexpected_interruptions>\d+) (?:unexpected|unplanned) interruptions in (?:a )?(?P<llama3_days>\d+)"
    r"(?:-day|\s+days)",
    r"interruptions in (?P<llama3_days>\d+) days on 16,384",
    r"(?i)MTBF[:=]\s*(?P<llama3_job_mtbf_h>[\d.]+) h\b",
    r"days \((?P<llama3_job_mtbf_h>[\d.]+) h\) and a (?P<worked_save_s>\d+) s blocking save",
    r"(?P<worked_save_s>\d+)-second save and a (?P<llama3_job_mtbf_h>[\d.]+)-hour job MTBF",
    r"(?P<young_minutes>[\d.]+) min at C=(?P<worked_save_s>\d+) s",
    r"about every (?P<young_minutes>[\d.]+) minutes at (?P<young_overhead>[\d.]+%) overhead",
    r"and about (?P<young_minutes>[\d.]+) minutes, each within",
    r"async saving \((?P<worked_async_save_s>\d+) s blocking\) moves it to (?P<async_young_minutes>[\d.]+) minutes and"
    r" (?P<async_young_overhead>[\d.]+%)",
    r"\(above, (?P<worked_save_s>\d+) s → (?P<worked_async_save_s>\d+) s: (?P<young_overhead>[\d.]+%) → "
    r"(?P<async_young_overhead>[\d.]+%)\)",
)


def shapes() -> tuple[re.Pattern[str], ...]:
    """`STATED`, compiled, each bare space matching any whitespace."""
    spaced = re.compile(r"(\[(?:\\.|[^\]])*\])| ")  # a character class is kept as written
    return tuple(re.compile(spaced.sub(lambda m: m[1] or r"\s+", shape)) for shape in STATED)


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
