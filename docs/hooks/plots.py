"""MkDocs hook: plots of measured runs, rendered to SVG at build time.

`docs/data/NAME.json` is written by `python -m reference_impl.bench.measure` and committed:
`{"device", "torch", "date", "commit", "command", "data"}`. Each build renders it with
matplotlib (Agg, text as paths, so no font is fetched) into `plots/NAME.svg` in the site,
and into `plots/NAME-narrow.svg` for phones. A plot is a white card in both palettes: no
grey reads at 4.5:1 on both white and slate, so the text is dark grey (10.4:1 on white)
and every series at least 3:1. `<!-- plot: NAME -->` on a page becomes the figure, sized
so that nothing shifts when it loads, with a caption naming the device, the date and the
command that regenerates the data. A data
file that is not valid JSON, lacks a metadata key, or whose `data` does not fit its plot
stops the build with a `PlotDataError` that names the file.
"""

from __future__ import annotations

import html
import json
import posixpath
import re
import statistics
import textwrap
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import matplotlib
from cycler import cycler

matplotlib.use("Agg")
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from reference_impl import calc  # noqa: E402

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
METADATA = ("device", "torch", "date", "commit", "command")
# Data files that `hooks/tables.py` shows as tables, not plots.
TABLE_DATA = ("memory_grid", "memory_grid_reduced", "gpu", "gpu_small", "gpu_fp8", "gpu_profile", "accessibility_known",
              "goodput")
# Plots whose data a script writes (it runs longer than `python -m reference_impl.bench.measure` should).
SCRIPTED = {"goodput_sweep": "python scripts/goodput_sweep.py"}
MARK = re.compile(r"<!-- plot: (?P<name>[a-z_]+) -->")
INK = "#404040"  # text and axes
GREY = "#6b6b6b"  # a grey series, 5.3:1
BAND = "#8a8a8a"  # the broad reference line the attempts are drawn over, 3.5:1
COLOURS = ("#0072b2", "#d55e00", "#007d5a", "#8e44ad", "#c0392b")  # 5.2, 3.9, 5.2, 5.9, 5.4:1
BACKGROUND = "#ffffff"
STYLE = {"svg.fonttype": "path", "svg.hashsalt": "handbook", "font.size": 10, "text.color": INK,
         "axes.labelcolor": INK, "axes.edgecolor": INK, "xtick.color": INK, "ytick.color": INK,
         "axes.grid": True, "grid.color": INK, "grid.alpha": 0.15, "legend.frameon": False,
         "axes.spines.top": False, "axes.spines.right": False, "axes.prop_cycle": cycler(color=COLOURS)}
# Inches. The wide figure shows at its own size on a desktop; a phone's ~360 px column
# would shrink its 8-point labels to 5 px, so phones get the narrow one, near its own size.
SIZES = {"wide": (7.0, 3.6), "narrow": (4.2, 4.8)}
NARROW_MEDIA = "(max-width: 599px)"
WRAP = 44  # characters per line of a label in the narrow figure


class PlotDataError(ValueError):
    """A data file cannot be plotted: not JSON, a missing metadata key, or malformed data."""


def _legend_below(ax: Any, ncols: int) -> None:
    """The axes' legend under the figure, in `ncols` columns, or one on the narrow figure."""
    fig = ax.figure
    narrow = fig.get_figwidth() < SIZES["wide"][0]
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=1 if narrow else ncols,
               fontsize=8)


def _resume(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    steps, losses = zip(*d["uninterrupted"])
    ax.plot(steps, losses, color=BAND, lw=6, label="uninterrupted run")
    for (label, style, size), attempt in zip((("attempt 1 (killed)", "-o", 5), ("attempt 2 (restored)", "--s", 3)),
                                             d["attempts"]):
        ax.plot(*zip(*attempt), style, ms=size, lw=1.4, label=label)
    ax.axvline(d["fail_at_step"], color=COLOURS[4], ls=":", lw=1.5,
               label=f"rank 1 SIGKILLed before step {d['fail_at_step']}")
    ax.axvline(d["restored_step"], color=COLOURS[2], ls="-.", lw=1.5,
               label=f"checkpoint of step {d['restored_step']} restored")
    ax.set(xlabel="optimizer step", ylabel="training loss (mean over ranks)")
    _legend_below(ax, 3)


def _phases(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    names = list(d["cases"])
    left = [0.0] * len(names)
    for colour, phase in zip((*COLOURS, GREY), d["phases"]):
        widths = [d["cases"][n][phase] for n in names]
        ax.barh(names, widths, left=left, color=colour, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set(xlabel=f"ms per optimizer step (global batch {d['global_batch_size']}, {d['world_size']} ranks)")
    ax.grid(axis="y", visible=False)
    _legend_below(ax, len(d["phases"]))


def _async(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    sync, blocked, total = d["sync_s"], d["blocked_s"], d["async_total_s"]
    ax.barh(["sync save"], [sync], height=0.5, color=COLOURS[4], label="training blocked")
    ax.barh(["async save"], [blocked], height=0.5, color=COLOURS[4])
    ax.barh(["async save"], [total - blocked], height=0.5, left=[blocked], color=COLOURS[0],
            label="written and published in the background (training runs)")
    for y, x in ((0, sync), (1, blocked), (1, total)):
        # Under the bar, on white: dark text on a red or blue bar would not read.
        ax.annotate(f"{x:.2f} s", (x, y + 0.25), xytext=(0, -2), textcoords="offset points", fontsize=8,
                    ha="center", va="top")
    ax.margins(y=0.3)  # room for the times under the lower bar
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    ax.set(xlabel=f"seconds from the save call (FSDP, {d['params'] / 1e6:.1f}M parameters, "
                  f"{d['world_size']} ranks, median of {d['rounds']})")
    _legend_below(ax, 1)


MEMORY_XLABEL = "model parameters (GPT-3-like shapes to 13B, OPT-30B, Llama-2-70B)"


def _memory(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    params = [m["params"] for m in d["models"]]
    # GB of 10^9 bytes, as the page's text, its calculators and the H100's "80 GB" count them.
    for colour, (stage, points) in zip(COLOURS, d["curves"].items()):
        ax.plot(params, [p["total_bytes"] / 1e9 for p in points], "-o", ms=3, color=colour,
                label=stage.upper() if stage == "ddp" else f"ZeRO-{stage[-1]}")
    ax.axhline(80, color=GREY, ls="--", lw=1)
    ax.annotate("80 GB: one H100", (params[0], 80), xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel=MEMORY_XLABEL,
           ylabel=f"GB (10⁹ bytes) per GPU ({d['inputs']['world_size']} GPUs)")
    ax.set_xticks(params, [m["name"] for m in d["models"]], fontsize=8)
    ax.minorticks_off()
    ax.legend(fontsize=8)


def _size(n: float) -> str:
    return f"{n / 2 ** 20:g} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:g} KiB"


def _allreduce(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    sizes = d["sizes_bytes"]
    for size, runs in zip(sizes, d["measured_s"]):
        ax.plot([size] * len(runs), [1e3 * t for t in runs], ".", color=GREY, ms=3)
    ax.plot(sizes, [1e3 * t for t in d["median_s"]], "o", color=COLOURS[0],
            label=f"gloo, {d['world_size']} ranks: median of {d['repeats']} (dots: each run)")
    ax.plot(sizes, [1e3 * t for t in d["formula_s"]], "-", color=COLOURS[1],
            label=f"ring formula: {d['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
                  f"{1e6 * d['latency_s']:.0f} µs per step")
    ax.set(xscale="log", yscale="log", xlabel="message size", ylabel="all-reduce time (ms)")
    ax.set_xticks(sizes, [_size(s) for s in sizes], fontsize=8)
    ax.minorticks_off()
    ax.legend(fontsize=8, loc="upper left")


def _pipeline(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    for style, v in zip(("-", "--"), sorted({c["virtual_stages"] for c in d["cases"]})):
        formula = {c["microbatches"]: c["formula_idle"] for c in d["cases"] if c["virtual_stages"] == v}
        ax.plot(list(formula), list(formula.values()), style, color=GREY, lw=2,
                label=f"(P-1)/({'' if v == 1 else v}M+P-1), P = {d['pp_degree']}")
    counts = sorted({c["microbatches"] for c in d["cases"]})
    for colour, marker, kind in zip(COLOURS, "os^", dict.fromkeys(c["schedule"] for c in d["cases"])):
        cases = [c for c in d["cases"] if c["schedule"] == kind]
        ax.plot([c["microbatches"] for c in cases], [c["measured_idle"] for c in cases], marker, color=colour,
                label=f"{kind}, measured")
    ax.set(xscale="log", xlabel="micro-batches per step M", ylabel="idle share of each stage's step")
    ax.set_xticks(counts, [str(m) for m in counts])
    ax.minorticks_off()
    ax.legend(fontsize=8)


def _up_kept(run: dict[str, Any], kind: str) -> float:
    """The share of the time spent computing or saving that ended as kept steps."""
    return run[f"{kind}_goodput"] / (1 - run[f"{kind}_restart_fraction"])


def _goodput_sweep(fig: Figure, d: dict[str, Any]) -> None:
    """Left: against the job's failure rate at one checkpoint interval; right: against the
    interval at one rate. Restarts are left out (their share is R/(M+R) at any interval, and R
    followed the machine's load). Dots: measured; rings: `calc.goodput` fed that run's own
    costs; line: the model at the sweep's median save cost and interval."""
    runs = [r["result"] for r in d["runs"]]
    every = statistics.median([r["checkpoint_every"] for r in runs])  # the interval the rate sweep holds
    by_rate = [r for r in runs if r["checkpoint_every"] == every]
    rate_mtbf = statistics.median([r["target_mtbf_s"] for r in runs if r["checkpoint_every"] != every])
    by_interval = [r for r in runs if r["target_mtbf_s"] == rate_mtbf]
    save = statistics.median([r["save_s"] for r in runs])
    tau = statistics.median([r["interval_s"] for r in by_rate])

    def model(mtbf_s: float, interval_s: float, restart_s: float = 0.0) -> float:
        return calc.goodput(n_gpus=1, mtbf_gpu_hours=mtbf_s / 3600, save_s=save, restart_s=restart_s,
                            interval_s=interval_s)["goodput"]

    def span(values: list[float]) -> list[float]:
        lo, hi = min(values) * 0.7, max(values) * 1.4
        return [lo * (hi / lo) ** (i / 40) for i in range(41)]

    narrow = fig.get_figwidth() < SIZES["wide"][0]
    left, right = fig.subplots(2, 1) if narrow else fig.subplots(1, 2, sharey=True)
    xs = span([60 / r["job_mtbf_s"] for r in by_rate])
    left.plot(xs, [model(60 / x, tau) for x in xs], "-", color=GREY, lw=2,
              label=f"model, restarts left out (save {save:.2f} s)")
    # Rings first, filled with the card's white, so the measured marker sits on top of its ring.
    for kind, colour, size, label in (("predicted", COLOURS[1], 10, None),
                                      ("measured", COLOURS[2], 5, "measured, restarts included")):
        left.plot([60 / r["job_mtbf_s"] for r in by_rate], [r[f"{kind}_goodput"] for r in by_rate], "s",
                  color=colour, ms=size, mfc=colour if kind == "measured" else BACKGROUND, label=label)
    left.set(xscale="log", xlabel=f"failures/min (∝ GPUs), save every {every} steps",
             ylabel="kept share" if narrow else "share of wall time kept")
    xs = span([r["interval_s"] for r in by_interval])
    right.plot(xs, [model(rate_mtbf, x) for x in xs], "-", color=GREY, lw=2)
    right.set(xscale="log", xlabel=f"seconds between saves, a failure every {rate_mtbf:g} s",
              ylabel="kept share" if narrow else "")
    for ax, points, x in ((left, by_rate, lambda r: 60 / r["job_mtbf_s"]),
                          (right, by_interval, lambda r: r["interval_s"])):
        ax.plot([x(r) for r in points], [_up_kept(r, "predicted") for r in points], "o", mfc=BACKGROUND, ms=10,
                color=COLOURS[1], label="model fed that run's own costs" if ax is left else None)
        ax.plot([x(r) for r in points], [_up_kept(r, "measured") for r in points], "o", color=COLOURS[0], ms=6,
                label="measured, restarts left out" if ax is left else None)
        ax.minorticks_off()
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylim(0, 1)
    _legend_below(left, 1 if narrow else 2)


Renderer = Callable[[Figure, dict[str, Any]], None]
PLOTS: dict[str, tuple[Renderer, str, str]] = {
    "resume": (_resume, "Loss of a killed and resumed run over the uninterrupted run",
               "Two ranks under torchrun, checkpoint every 10 steps, one loss per step. Rank 1 dies "
               "before step 15; torchrun restarts both ranks, they restore step 10 and replay 11-14, "
               "and every replayed and later loss equals the uninterrupted run's."),
    "phases": (_phases, "Step time by phase for DDP, FSDP and gradient accumulation",
               "The trainer's own phase timers (the `phase_s` of its `step` events) for a small "
               "transformer on two CPU ranks, first log window left out. Same global batch in each "
               "row; with accumulation it arrives as four micro-batches. On a CPU, h2d is nothing."),
    "async_checkpoint": (_async, "Sync against async checkpoint timeline",
                         "How long training waits for a sync FSDP save and for an async one, and when the "
                         "async one is published (`python -m reference_impl.bench async`)."),
    "memory": (_memory, "Memory per GPU by ZeRO stage against model size",
               "Computed, not measured: `reference_impl.calc.memory`, whose terms are checked by its "
               "unit tests. Mixed-precision Adam (16 bytes per parameter), 8 GPUs, sequence 2048, "
               "micro-batch 1, activation checkpointing. Hidden size and layers as GPT-3's models up "
               "to 6.7B, then 13B at 5120 × 40, OPT-30B's 7168 × 48 and Llama-2-70B's 8192 × 80 (a "
               "GPT block, no vocabulary term); GB are 10^9 bytes."),
    "allreduce": (_allreduce, "Ring all-reduce time against message size",
                  "float32 all-reduce on two gloo ranks against `reference_impl.calc.ring_allreduce`, "
                  "with its bandwidth and per-step latency fitted to the medians (least squares on the "
                  "relative error)."),
    "goodput_sweep": (_goodput_sweep, "Goodput against failure rate and checkpoint interval",
                      "Two ranks of the trainer under torchrun, a random rank SIGKILLed at random moments "
                      "(some inside saves and restores) by `python -m reference_impl.bench goodput`, one run "
                      "per point. A job of more GPUs fails more often (the rate is the GPU count times each "
                      "GPU's), so the left panel is the GPU-count axis. Restarting took 5 to 22 s, following "
                      "the machine's load, and its share R/(M+R) does not depend on the interval: the dots "
                      "and the line leave it out, the squares keep it. Rings: the model fed each run's own "
                      "save, restart, interval and failure rate."),
    "pipeline": (_pipeline, "Pipeline bubble against micro-batches",
                 "Each rank's idle share of a step on two ranks whose forward and backward sleep known "
                 "times, cut into two stages per rank under interleaved 1F1B (`python -m "
                 "reference_impl.bench pipeline`), against `reference_impl.parallel.pipeline.bubble_fraction`."),
}


def load(path: Path) -> dict[str, Any]:
    """Read a data file and check its metadata.

    Raises:
        PlotDataError: Not JSON, not an object, or a metadata key (or `data`) missing or empty.
    """
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise PlotDataError(f"{path}: not readable as JSON: {exc}") from None
    if not isinstance(record, dict):
        raise PlotDataError(f"{path}: expected a JSON object")
    for key in METADATA:
        if not isinstance(record.get(key), str) or not record[key]:
            raise PlotDataError(f"{path}: metadata {key!r} is missing or empty")
    if not isinstance(record.get("data"), dict):
        raise PlotDataError(f"{path}: 'data' is missing or not an object")
    return record


def _narrow(fig: Figure) -> None:
    """Fit a drawn figure to the narrow size: wrapped labels, slanted ticks."""
    for ax in fig.axes:
        ax.set_xlabel(textwrap.fill(ax.get_xlabel(), WRAP))
        ax.set_ylabel(textwrap.fill(ax.get_ylabel(), WRAP))
        ax.tick_params(axis="x", labelrotation=40)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")


def pixels(size: str) -> tuple[int, int]:
    """Width and height in CSS pixels (96 to the inch) of the figure of that size."""
    width, height = SIZES[size]
    return round(width * 96), round(height * 96)


def render(path: Path, size: str = "wide") -> str:
    """The SVG of the data file `path` (its stem names the plot) at a size of `SIZES`.

    Raises:
        PlotDataError: The file is malformed, or no plot has its name.
    """
    if path.stem not in PLOTS:
        raise PlotDataError(f"{path}: no plot is named {path.stem!r} (known: {', '.join(PLOTS)})")
    record, (draw, title, _) = load(path), PLOTS[path.stem]
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=SIZES[size], layout="constrained", facecolor=BACKGROUND)
        try:
            draw(fig, record["data"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise PlotDataError(f"{path}: 'data' does not fit the {path.stem} plot: {exc!r}") from None
        if size == "narrow":
            _narrow(fig)
        fig.suptitle(textwrap.fill(title, WRAP) if size == "narrow" else title)
        out = StringIO()
        fig.savefig(out, format="svg", facecolor=BACKGROUND, metadata={"Date": None})
    return out.getvalue()


def figure(name: str, page_url: str) -> str:
    """The figure that replaces `<!-- plot: name -->` on the page at `page_url`."""
    path = DATA_DIR / f"{name}.json"
    if name not in PLOTS or not path.exists():
        raise PlotDataError(f"<!-- plot: {name} -->: no plot or data file {path}")
    record, (_, title, caption) = load(path), PLOTS[name]
    base = page_url if page_url.endswith("/") else posixpath.dirname(page_url)
    up = posixpath.relpath(".", base.rstrip("/") or ".")
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(caption))
    command = html.escape(record["command"])
    made = "Computed" if name == "memory" else "Measured"
    (width, height), (narrow_width, narrow_height) = pixels("wide"), pixels("narrow")
    return (f'<figure class="handbook-plot">\n<picture><source media="{NARROW_MEDIA}" '
            f'srcset="{up}/plots/{name}-narrow.svg" width="{narrow_width}" height="{narrow_height}">'
            f'<img src="{up}/plots/{name}.svg" width="{width}" height="{height}" alt="{html.escape(title)}">'
            "</picture>\n"
            f"<figcaption>{text} {made} on {html.escape(record['device'])}, {record['date']}, "
            f"torch {html.escape(record['torch'])}, commit {html.escape(record['commit'])}. "
            f'Regenerate with <code>{command}</code>; data: <a href="{up}/data/{name}.json">{name}.json</a>.'
            "</figcaption>\n</figure>")


def on_files(files: Any, config: Any, **_: Any) -> Any:
    """Add `plots/NAME.svg` and `plots/NAME-narrow.svg`, rendered from `docs/data/NAME.json`."""
    from mkdocs.structure.files import File

    for path in sorted(DATA_DIR.glob("*.json")):
        if path.stem in TABLE_DATA:
            continue
        files.append(File.generated(config, f"plots/{path.stem}.svg", content=render(path)))
        files.append(File.generated(config, f"plots/{path.stem}-narrow.svg", content=render(path, "narrow")))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace each `<!-- plot: NAME -->` with its figure and caption."""
    return MARK.sub(lambda m: figure(m["name"], page.url), markdown)
