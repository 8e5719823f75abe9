"""The plots of measured runs: committed data with its metadata, sane values, formulas equal to
the tested functions, every plot on its page as a valid SVG, a clear error on bad data."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from datetime import date
from html.parser import HTMLParser
from pathlib import Path

import pytest

import handbook_docs_support as support
from reference_impl import calc
from reference_impl.bench.measure import COMMAND, DATASETS
from reference_impl.metrics import PHASES
from reference_impl.parallel.pipeline import bubble_fraction

sys.path.insert(0, str(support.DOCS / "hooks"))
import plots  # noqa: E402

DATA = support.DOCS / "data"
PAGES = {"reliability/checkpointing.md": ("resume", "async_checkpoint"), "reliability/failure-model.md": ("goodput_sweep",), "reliability/performance.md": ("phases",),
         "foundations/data-parallel.md": ("memory", "allreduce"), "foundations/tensor-pipeline.md": ("pipeline",)}
IMG = re.compile(r'<img [^>]*src="(?P<src>[^"]*plots/(?P<name>\w+)\.svg)"')
STYLE = re.compile(r'style="(?P<style>[^"]*)"')


def record(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def test_one_committed_data_file_per_plot_and_dataset() -> None:
    """Every data file is a plot's, except those the tables hook shows as tables."""
    plotted = sorted(p.stem for p in DATA.glob("*.json") if p.stem not in plots.TABLE_DATA)
    assert plotted == sorted([*DATASETS, *plots.SCRIPTED]) == sorted(plots.PLOTS)
    assert all((DATA / f"{name}.json").exists() for name in plots.TABLE_DATA)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_data_file_carries_its_metadata(name: str) -> None:
    rec = record(name)
    assert set(rec) == {"device", "torch", "date", "commit", "command", "data"}
    assert all(isinstance(rec[k], str) and rec[k] for k in plots.METADATA)
    date.fromisoformat(rec["date"])
    assert re.fullmatch(r"[0-9a-f]{7,40}", rec["commit"])
    assert rec["command"] == f"{COMMAND} --only {name}"
    assert plots.load(DATA / f"{name}.json") == rec


def test_goodput_sweep_loses_nothing_and_agrees_with_the_model() -> None:
    """Every point of the sweep ended on the uninterrupted run's state and was hit by failures (a
    random count: at least 3 each, 50 in all); its measured goodput is within 10% of calc.goodput's
    prediction from its own costs; the sweep spans at least three failure rates at one interval and
    three intervals at one rate."""
    rec = record("goodput_sweep")
    assert rec["command"] == plots.SCRIPTED["goodput_sweep"]
    runs = [run["result"] for run in rec["data"]["runs"]]
    for run in rec["data"]["runs"]:
        r = run["result"]
        assert run["command"].startswith("python -m reference_impl.bench goodput ")
        assert r["digest_equal"] and r["state_digest"] == r["reference_digest"]
        assert r["failures"] >= 3
        assert r["measured_goodput"] == pytest.approx(r["predicted_goodput"], rel=0.1)
        assert r["predicted_goodput"] == pytest.approx(calc.goodput(
            n_gpus=1, mtbf_gpu_hours=r["job_mtbf_s"] / 3600, save_s=r["save_s"], restart_s=r["restart_s"],
            interval_s=r["interval_s"])["goodput"], abs=1e-3)
    assert sum(r["failures"] for r in runs) >= 50
    rates = {r["target_mtbf_s"] for r in runs if r["checkpoint_every"] == 20}
    intervals = {r["checkpoint_every"] for r in runs if r["target_mtbf_s"] == 8}
    assert len(rates) >= 3 and len(intervals) >= 3


def test_resumed_run_repeats_the_uninterrupted_losses() -> None:
    d = record("resume")["data"]
    clean = dict(d["uninterrupted"])
    killed, restored = (dict(a) for a in d["attempts"])
    assert sorted(clean) == list(range(1, 31))
    assert max(killed) == d["fail_at_step"] - 1  # rank 1 died before the step of the fault
    assert min(restored) == d["restored_step"] + 1 and max(restored) == 30
    assert d["restored_step"] % d["checkpoint_every"] == 0 and d["restored_step"] < d["fail_at_step"]
    assert all(clean[s] == loss for s, loss in [*killed.items(), *restored.items()])  # bit for bit
    assert d["state_digests"]["resumed"] == d["state_digests"]["uninterrupted"]


def test_phases_cover_every_case_and_phase() -> None:
    d = record("phases")["data"]
    assert d["phases"] == list(PHASES)
    assert set(d["cases"]) == {"DDP", "FSDP", "DDP, accumulation x4"}
    for phases in d["cases"].values():
        assert set(phases) == set(PHASES) and all(v >= 0 for v in phases.values())
        assert phases["forward"] > 0 and phases["backward"] > 0


def test_async_timeline_is_ordered() -> None:
    d = record("async_checkpoint")["data"]
    assert 0 < d["blocked_s"] <= d["async_total_s"] and d["sync_s"] > 0
    assert d["world_size"] == 2 and d["params"] > 1e6


def test_memory_curves_are_calc_memory() -> None:
    d = record("memory")["data"]
    assert list(d["curves"]) == ["ddp", "zero1", "zero2", "zero3"]
    for stage, points in d["curves"].items():
        for model, point in zip(d["models"], points, strict=True):
            shape = {k: model[k] for k in ("params", "hidden", "n_layers", "n_heads")}
            assert point == calc.memory(strategy=stage, **shape, **d["inputs"])


def test_memory_plot_counts_gb_as_the_page_does_and_names_its_shapes() -> None:
    """The memory plot's axis is in GB of 10^9 bytes, as the page's text and its 80 GB line;
    its 70B point is Llama-2-70B's shape and the labels say so, not "GPT-3 shapes"."""
    from matplotlib.figure import Figure

    d = record("memory")["data"]
    fig = Figure()
    plots._memory(fig, d)
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("GB (10⁹ bytes) per GPU")
    curves, (limit,) = ax.get_lines()[:4], ax.get_lines()[4:]
    for line, points in zip(curves, d["curves"].values(), strict=True):
        assert list(line.get_ydata()) == [p["total_bytes"] / 1e9 for p in points]
    assert list(limit.get_ydata()) == [80, 80]
    seventy = next(m for m in d["models"] if m["name"] == "70B")
    assert (seventy["hidden"], seventy["n_layers"], seventy["n_heads"]) == (8192, 80, 64)  # Llama-2-70B
    assert "Llama-2-70B" in ax.get_xlabel() and "Llama-2-70B" in plots.PLOTS["memory"][2]
    assert "GPT-3 shapes" not in ax.get_xlabel()
    assert "80 GB GPU" in (support.DOCS / "foundations" / "data-parallel.md").read_text(encoding="utf-8")


def test_allreduce_formula_is_calc_ring_allreduce() -> None:
    d = record("allreduce")["data"]
    sizes = d["sizes_bytes"]
    assert sizes == sorted(sizes) and sizes[0] <= 2 ** 10 and sizes[-1] >= 2 ** 24
    assert all(len(runs) == d["repeats"] >= 3 for runs in d["measured_s"])
    for size, runs, median, formula in zip(sizes, d["measured_s"], d["median_s"], d["formula_s"], strict=True):
        assert median == sorted(runs)[len(runs) // 2]
        assert formula == pytest.approx(calc.ring_allreduce(
            size_bytes=size, world_size=2, bandwidth_bytes_per_s=d["bandwidth_bytes_per_s"],
            latency_s=d["latency_s"])["time_s"])
    assert d["bandwidth_bytes_per_s"] > 0 and d["latency_s"] > 0


def test_pipeline_formula_is_bubble_fraction() -> None:
    d = record("pipeline")["data"]
    assert {c["schedule"] for c in d["cases"]} == {"gpipe", "1f1b", "interleaved-1f1b"}
    for case in d["cases"]:
        v = case["virtual_stages"]
        assert v == (2 if case["schedule"] == "interleaved-1f1b" else 1)
        assert case["formula_idle"] == round(bubble_fraction(d["pp_degree"], case["microbatches"], v), 4)
        assert case["formula_idle"] == round(calc.pipeline_bubble(
            stages=d["pp_degree"], microbatches=case["microbatches"], interleave=v)["bubble_fraction"], 4)
        assert 0 < case["measured_idle"] < 1


def test_every_plot_is_on_its_page_as_a_valid_svg(built_site: Path) -> None:
    for page, names in PAGES.items():
        html_path = built_site / page.removesuffix(".md") / "index.html"
        text = html_path.read_text(encoding="utf-8")
        found = {m["name"]: m["src"] for m in IMG.finditer(text)}
        assert set(names) <= set(found), f"{page}: plots {sorted(found)}"
        for name in names:
            svg = (html_path.parent / found[name]).resolve()
            assert svg == built_site / "plots" / f"{name}.svg"
            root = ET.parse(svg).getroot()
            assert root.tag == "{http://www.w3.org/2000/svg}svg"
            assert "<text" not in svg.read_text(encoding="utf-8")  # text drawn as paths: no font needed
            caption = text[text.index(found[name]):].split("</figcaption>")[0]
            rec = record(name)
            assert rec["date"] in caption and f"<code>{rec['command']}</code>" in caption
            assert rec["device"] in caption.replace("&amp;", "&")
    memory_caption = (built_site / "foundations/data-parallel/index.html").read_text(encoding="utf-8")
    assert "Computed, not measured: <code>reference_impl.calc.memory</code>" in memory_caption


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not readable as JSON"),
    ('["a list"]', "expected a JSON object"),
    (json.dumps({"torch": "2", "date": "d", "commit": "c", "command": "x", "data": {}}), "'device'"),
    (json.dumps({"device": "d", "torch": "2", "date": "d", "commit": "c", "command": "x"}), "'data'"),
    (json.dumps({"device": "d", "torch": "2", "date": "d", "commit": "c", "command": "x",
                 "data": {"uninterrupted": [[1, 2.0]]}}), "does not fit the resume plot"),
])
def test_renderer_fails_clearly_on_malformed_data(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "resume.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(plots.PlotDataError, match=re.escape(message)) as raised:
        plots.render(path)
    assert str(path) in str(raised.value)


def test_renderer_refuses_an_unknown_plot(tmp_path: Path) -> None:
    path = tmp_path / "nonesuch.json"
    path.write_text(json.dumps(record("memory")), encoding="utf-8")
    with pytest.raises(plots.PlotDataError, match="no plot is named 'nonesuch'"):
        plots.render(path)


def _luminance(colour: str) -> float:
    channels = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two #rrggbb colours."""
    high, low = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_plot_text_and_series_read_on_their_white_card() -> None:
    assert plots.BACKGROUND == "#ffffff"
    assert contrast(plots.INK, plots.BACKGROUND) >= 4.5
    for colour in (*plots.COLOURS, plots.GREY, plots.BAND):
        assert contrast(colour, plots.BACKGROUND) >= 3, colour


def test_every_colour_drawn_in_a_plot_reads_on_white(built_site: Path) -> None:
    """Each fill and stroke is the white card, the faint grid, or a colour at 3:1 or more."""
    for name in plots.PLOTS:
        for svg in (built_site / "plots" / f"{name}.svg", built_site / "plots" / f"{name}-narrow.svg"):
            for style in {m["style"] for m in STYLE.finditer(svg.read_text(encoding="utf-8"))}:
                props = dict(part.split(": ", 1) for part in style.split("; ") if ": " in part)
                if props.get("stroke-opacity") == str(plots.STYLE["grid.alpha"]):
                    assert props["stroke"] == plots.INK, (svg.name, style)
                    continue
                assert not any(key.endswith("opacity") for key in props), (svg.name, style)
                for key in ("fill", "stroke"):
                    colour = props.get(key, "none")
                    if colour not in ("none", plots.BACKGROUND):
                        assert contrast(colour, plots.BACKGROUND) >= 3, (svg.name, style)


class _Pictures(HTMLParser):
    """The attributes of each plot's <source> and <img>, by the plot's name."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: dict[tuple[str, str], dict[str, str]] = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        url = attrs.get("srcset") if tag == "source" else attrs.get("src")
        if tag in ("source", "img") and url and "/plots/" in url:
            name = url.rsplit("/", 1)[1].removesuffix(".svg").removesuffix("-narrow")
            self.found[(name, tag)] = attrs


def test_plots_carry_their_size_and_a_narrow_variant(built_site: Path) -> None:
    """Width and height on the page reserve the plot's room; phones get the narrow figure."""
    for page, names in PAGES.items():
        parser = _Pictures()
        parser.feed((built_site / page.removesuffix(".md") / "index.html").read_text(encoding="utf-8"))
        for name in names:
            source, img = parser.found[(name, "source")], parser.found[(name, "img")]
            assert source["media"] == plots.NARROW_MEDIA and source["srcset"].endswith(f"{name}-narrow.svg")
            assert (int(source["width"]), int(source["height"])) == plots.pixels("narrow")
            assert (int(img["width"]), int(img["height"])) == plots.pixels("wide")
    for name in plots.PLOTS:
        for size, suffix in (("wide", ""), ("narrow", "-narrow")):
            root = ET.parse(built_site / "plots" / f"{name}{suffix}.svg").getroot()
            points = float(root.get("width").removesuffix("pt")), float(root.get("height").removesuffix("pt"))
            assert tuple(round(p * 4 / 3) for p in points) == plots.pixels(size), (name, size)
