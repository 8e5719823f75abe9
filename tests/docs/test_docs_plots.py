"""The plots of measured runs: committed data with its metadata, sane values, formulas equal to
the tested functions, every plot on its page as a valid SVG, a clear error on bad data."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from datetime import date
from pathlib import Path

import pytest

import handbook_docs_support as support
from reference_impl import calc
from reference_impl.measure import COMMAND, DATASETS
from reference_impl.metrics import PHASES
from reference_impl.pipeline import bubble_fraction

sys.path.insert(0, str(support.DOCS / "hooks"))
import plots  # noqa: E402

DATA = support.DOCS / "data"
PAGES = {"reliability/checkpointing.md": ("resume", "async_checkpoint"), "reliability/performance.md": ("phases",),
         "foundations/parallelism.md": ("memory", "allreduce", "pipeline")}
IMG = re.compile(r'<img [^>]*src="(?P<src>[^"]*plots/(?P<name>\w+)\.svg)"')


def record(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def test_one_committed_data_file_per_plot_and_dataset() -> None:
    """Every data file is a plot's, except those the tables hook shows as tables."""
    plotted = sorted(p.stem for p in DATA.glob("*.json") if p.stem not in plots.TABLE_DATA)
    assert plotted == sorted(DATASETS) == sorted(plots.PLOTS)
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
    assert {c["schedule"] for c in d["cases"]} == {"gpipe", "1f1b"}
    for case in d["cases"]:
        assert case["formula_idle"] == round(bubble_fraction(d["pp_degree"], case["microbatches"]), 4)
        assert case["formula_idle"] == round(calc.pipeline_bubble(
            stages=d["pp_degree"], microbatches=case["microbatches"])["bubble_fraction"], 4)
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
    memory_caption = (built_site / "foundations/parallelism/index.html").read_text(encoding="utf-8")
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
