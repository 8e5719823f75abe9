"""MkDocs hook: tables computed by the tested package at build time, never typed by hand.

`<!-- table: NAME -->` on a page becomes the Markdown table `TABLES[NAME]()` returns:

* `mesh_ranking`: the fastest meshes of `reference_impl.calc.plan.search()` (a 70B model on 64
  H100s), each at its best micro-batch and checkpointing choice;
* `mesh_landmarks`: the meshes an interviewer names (DDP, HSDP in a node, FSDP, TP across
  nodes, TP + FSDP, TP + PP), each at its best setting, or why none of its settings runs;
* `memory_grid`, `memory_grid_reduced`: `calc.memory` against PyTorch's `FSDPMemTracker`
  on the grids that `python -m reference_impl.calc.memory_grid [--reduced]` writes to
  `docs/data/`, with the torch version and the date of the run;
* `gpu`: `python -m reference_impl.bench gpu` on a real GPU (`docs/data/gpu.json`, the JSON
  lines of its runs), eager, compiled and compiled in float8, with the device and versions;
* `gpu_ladder`: the DDP rows of `bench gpu` runs in `docs/data/gpu.json` that change one
  thing at a time (optimizer kernel, micro-batch, compilation), so each step's gain is read
  off the row above it;
* `gpu_small`: the same kind of ladder at GPT-2 small's shape (`docs/data/gpu_small.json`):
  eager, blocks compiled, loss compiled too, then more sequences per step;
* `gpu_host_bound`: `scripts/gpu_profile.py` on a real GPU (`docs/data/gpu_profile.json`): the
  219 M model at eight sequences, eager and compiled, each row's step time beside the GPU's
  kernel time and the launches per step, so a step the host holds back reads off its row;
* `gpu_fp8`: `python -m reference_impl.bench fp8` on a real GPU (`docs/data/gpu_fp8.json`):
  a float8 linear against bf16 by size, eager and compiled, and the bare matmuls' ratio;
* `pipeline_bubble`: the measured pipeline idle shares of `docs/data/pipeline.json`, the
  data file the `pipeline` plot beside it draws (`hooks/plots.py`), so table and plot
  always show the same run;
* `goodput`: `python -m reference_impl.bench goodput` runs (`docs/data/goodput.json`, their JSON
  lines): measured goodput of the trainer under random SIGKILLs against `calc.goodput`'s;
* `accessibility_known`: the axe-core findings on the theme's own elements that remain
  (`docs/data/accessibility_known.json`, the same file the accessibility test reads).

An unknown name stops the build with a `ValueError` that lists the known ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reference_impl.calc.plan import Plan, best_per_mesh, search

DATA = Path(__file__).resolve().parents[1] / "data"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved 1F1B"}
MARK = re.compile(r"<!-- table: (?P<name>[a-z0-9_]+) -->")
RANKED_ROWS = 6
LANDMARKS = {"64x1x1x1": "DDP", "8x8x1x1": "HSDP, shard in a node", "1x64x1x1": "FSDP2",
             "1x4x16x1": "TP 16 + FSDP2", "1x8x8x1": "TP 8 + FSDP2", "1x1x8x8": "TP 8 + PP 8"}
# Two narrow tables instead of one wide one, so that both fit a 720 px column: the landmarks
# say whether a mesh runs and how fast; the ranking where the step's time goes.
LANDMARK_HEADER = "| Mesh | Named | b | AC | GB | Step (s) | MFU | Verdict |"
RANKING_HEADER = "| Mesh | b | AC | GB | Compute (s) | TP (s) | FSDP/DP (s) | Bubble | Step (s) | MFU |"
LEGEND = ("\nMesh: data-parallel replicas × FSDP shards × TP × PP degrees. b: sequences per micro-batch. "
          "AC: activation checkpointing (recompute). GB: the per-GPU peak of `calc.memory`, 10⁹ bytes.")


def _setting(plan: Plan) -> str:
    """Mesh, micro-batch, recompute and memory cells of a priced plan."""
    return (f"| {plan.mesh.replace('x', '×')} | {plan.micro_batch} | {'yes' if plan.activation_checkpointing else 'no'} "
            f"| {plan.memory_bytes / 1e9:.1f} ")


def _landmark_row(plan: Plan, name: str) -> str:
    if plan.rejected and not plan.memory_bytes:  # rejected for its layout, before it was priced
        return f"| {plan.mesh.replace('x', '×')} | {name} | | | | | | {plan.rejected} |"
    mesh, rest = _setting(plan).split(" | ", 1)
    if plan.rejected:  # out of memory even at its smallest setting: no time to show
        return f"{mesh} | {name} | {rest}| | | {plan.rejected} |"
    return f"{mesh} | {name} | {rest}| {plan.step_time_s:.2f} | {plan.mfu:.1%} | runs |"


def _ranking_row(plan: Plan) -> str:
    return _setting(plan) + (f"| {plan.compute_s:.2f} | {plan.tp_comm_s:.2f} | {plan.dp_comm_s:.2f} "
                             f"| {plan.bubble_fraction:.1%} | {plan.step_time_s:.2f} | {plan.mfu:.1%} |")


def _table(header: str, rows: list[str]) -> str:
    """The table, narrow enough for the page's column (`handbook-compact` in extra.css), and its legend."""
    table = "\n".join([header, "|" + " --- |" * header.count(" |"), *rows])
    return f'<div class="handbook-compact" markdown>\n\n{table}\n\n</div>\n{LEGEND}'



def mesh_ranking() -> str:
    """The fastest meshes that run, best setting of each, and where their step's time goes."""
    runs = [plan for plan in best_per_mesh(search()) if not plan.rejected]
    return _table(RANKING_HEADER, [_ranking_row(plan) for plan in runs[:RANKED_ROWS]])


def mesh_landmarks() -> str:
    """The named meshes, each at its best setting or with the reason none runs."""
    best = {plan.mesh: plan for plan in best_per_mesh(search())}
    return _table(LANDMARK_HEADER, [_landmark_row(best[mesh], name) for mesh, name in LANDMARKS.items()])


def _memory_grid(name: str) -> str:
    """Per-rank peak by PyTorch's tracker and by the calculator, one row per configuration."""
    record = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
    gib = 2**30
    rows = ["| Configuration | Tracker peak (GiB) | Calculator (GiB) | Error |", "| --- | --- | --- | --- |"]
    # Rounded before formatting so that an error of -1e-9 reads +0.00%, not -0.00%.
    rows += [f"| {r['config']} | {r['tracker']['Total'] / gib:.3f} | {r['calculator']['total_bytes'] / gib:.3f} "
             f"| {round(r['error'], 4) + 0.0:+.2%} |" for r in record["data"]["rows"]]
    worst = max(abs(r["error"]) for r in record["data"]["rows"])
    rows.append(f"\n{len(record['data']['rows'])} configurations, largest error {worst:.2%}; torch "
                f"{record['torch']}, {record['device']}, {record['date']}, commit {record['commit']}. "
                f"Regenerate with `{record['command']}`.")
    return "\n".join(rows)


def pipeline_bubble() -> str:
    """Each schedule and micro-batch count of the measured pipeline run, with its metadata."""
    record = json.loads((DATA / "pipeline.json").read_text(encoding="utf-8"))
    rows = ["| Schedule | m | Step (s) | Busy (s) | Idle, measured | Idle, formula |",
            "| --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {SCHEDULES[c['schedule']]} | {c['microbatches']} | {c['step_s']:.3f} | {c['busy_s']:.3f} "
             f"| {c['measured_idle']:.3f} | {c['formula_idle']:.3f} |" for c in record["data"]["cases"]]
    rows.append(f"\n{record['data']['pp_degree']} stages, fastest of {record['data']['rounds']} steps per case; "
                f"torch {record['torch']}, {record['device']}, {record['date']}, commit {record['commit']}. "
                f"Regenerate with `{record['command']}`.")
    return "\n".join(rows)


def gpu() -> str:
    """Each `bench gpu` run of `docs/data/gpu.json`: throughput, MFU, memory, phases, stall."""
    record = json.loads((DATA / "gpu.json").read_text(encoding="utf-8"))
    rows = ["| Run | Strategy | Tokens/s | MFU | Peak GiB | calc.memory GiB | Forward ms | Backward ms "
            "| Optimizer ms | Async stall / sync |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in record["data"]["runs"].items():
        stall = run["checkpoint_stall"]
        for strategy in ("ddp", "fsdp"):
            r, phases = run[strategy], run[strategy]["phase_ms_per_step"]
            stalled = f"{stall['blocked_s']:.2f} s / {stall['sync_s']:.2f} s" if strategy == "fsdp" else "(FSDP only)"
            rows.append(f"| {name.replace('_', ' + ')} | {strategy.upper()} | {r['tokens_per_s']:,.0f} "
                        f"| {r['mfu']:.1%} | {r['peak_memory_gib']:.2f} | {r['predicted_memory_gib']['peak']:.2f} "
                        f"| {phases['forward']:.1f} | {phases['backward']:.1f} | {phases['optimizer']:.1f} "
                        f"| {stalled} |")
    first = next(iter(record["data"]["runs"].values()))
    rows.append(f"\n{first['global_batch_size']} sequences of {first['seq_len']} tokens per step, {first['steps']} "
                f"steps, the first 10 left out; MFU against {first['peak_bf16_flops'] / 1e12:.0f} TFLOP/s. "
                f"torch {record['torch']} (CUDA {record['data']['cuda']}), {record['device']}, {record['date']}, "
                f"commit {record['commit']}. Regenerate with `{record['command']}`.")
    return "\n".join(rows)


def ladder_rows(steps: list[dict[str, Any]]) -> list[str]:
    """A Markdown table of DDP `bench gpu` runs, one change per row: label, flags, tokens/s,
    MFU, phases, peak memory against `calc.memory`'s transient peak."""
    rows = ["| Run | Flags | Tokens/s | MFU | Forward ms | Backward ms | Optimizer ms | Peak GiB "
            "| calc.memory GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for step in steps:
        r, phases = step["result"]["ddp"], step["result"]["ddp"]["phase_ms_per_step"]
        rows.append(f"| {step['label']} | `{step['flags'] or '(defaults)'}` | {r['tokens_per_s']:,.0f} "
                    f"| {r['mfu']:.1%} | {phases['forward']:.1f} | {phases['backward']:.1f} "
                    f"| {phases['optimizer']:.1f} | {r['peak_memory_gib']:.2f} "
                    f"| {r['predicted_memory_gib']['peak']:.2f} |")
    return rows


def gpu_ladder() -> str:
    """The one-change-at-a-time DDP runs of `docs/data/gpu.json`: tokens/s, MFU, phases, memory."""
    record = json.loads((DATA / "gpu.json").read_text(encoding="utf-8"))
    rows = ladder_rows(record["data"]["ladder"]["steps"])
    rows.append(f"\n{record['data']['ladder']['note']}. torch {record['torch']}, {record['device']}, "
                f"{record['date']}, commit {record['commit']}.")
    return "\n".join(rows)


def gpu_small() -> str:
    """The one-change-at-a-time DDP runs at GPT-2 small's shape (`docs/data/gpu_small.json`)."""
    record = json.loads((DATA / "gpu_small.json").read_text(encoding="utf-8"))
    rows = ladder_rows(record["data"]["steps"])
    rows.append(f"\n{record['data']['note']}. torch {record['torch']} (CUDA {record['data']['cuda']}), "
                f"{record['device']}, {record['date']}, commit {record['commit']}. "
                f"Regenerate with `{record['command']}`.")
    return "\n".join(rows)


def gpu_fp8() -> str:
    """The `bench fp8` run of `docs/data/gpu_fp8.json`: per size, the layer's and the matmul's speed-up."""
    record = json.loads((DATA / "gpu_fp8.json").read_text(encoding="utf-8"))
    rows = ["| K | bf16 ms | FP8 ms | FP8 speed-up | Compiled: bf16 ms | FP8 ms | FP8 speed-up "
            "| Bare matmul speed-up |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in record["data"]["cases"]:
        ms = c["ms"]
        rows.append(f"| {c['k']:,} | {ms['layer bf16']:.2f} | {ms['layer fp8']:.2f} | {c['layer_speedup']:.2f}x "
                    f"| {ms['layer bf16 compiled']:.2f} | {ms['layer fp8 compiled']:.2f} "
                    f"| {c['layer_speedup_compiled']:.2f}x | {c['matmul_speedup']:.2f}x |")
    data = record["data"]
    rows.append(f"\nOne K x K linear layer, forward and backward of {data['tokens']:,} tokens under bf16 autocast; "
                f"median of {data['rounds']} rounds of {data['iters']} passes; speed-up is bf16 time over FP8 time. "
                f"torch {record['torch']}, {record['device']}, {record['date']}, commit {record['commit']}. "
                f"Regenerate with `{record['command']}`.")
    return "\n".join(rows)


def gpu_host_bound() -> str:
    """The profiled variants of `docs/data/gpu_profile.json`: step, kernel time, launches."""
    record = _record("gpu_profile")
    rows = ["| Run | Step (ms) | GPU kernels (ms) | GPU busy | Launches per step | Tokens/s |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in record["data"]["rows"]:
        rows.append(f"| {r['label']} | {r['step_ms_unprofiled']:.1f} | {r['kernel_ms']:.1f} "
                    f"| {min(1.0, r['kernel_ms'] / r['step_ms_unprofiled']):.0%} | {r['launches_per_step']:,} "
                    f"| {r['tokens_per_s']:,} |")
    rows.append(f"\n{record['data']['shape']}. {record['data']['note']}. torch {record['torch']}, {record['device']}, "
                f"{record['date']}, commit {record['commit']}. Regenerate with `{record['command']}`.")
    return "\n".join(rows)


def _record(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def _where(record: dict[str, Any]) -> str:
    return f"{record['device'].split(' (')[0]}, torch {record['torch']}, {record['date']}"


def benchmark_summary() -> str:
    """What the committed benchmark runs answer, one row each, every figure read from
    `docs/data/*.json` (the benchmarks page's opening table)."""
    small, big, fp8 = _record("gpu_small"), _record("gpu"), _record("gpu_fp8")
    async_cpu, resume = _record("async_checkpoint"), _record("resume")
    steps = small["data"]["steps"]
    best = max(steps, key=lambda s: s["result"]["ddp"]["mfu"])["result"]
    blocks, loss = steps[1]["result"]["ddp"], steps[2]["result"]["ddp"]
    stall = steps[2]["result"]["checkpoint_stall"]
    ladder = big["data"]["ladder"]["steps"]
    top = max(ladder, key=lambda s: s["result"]["ddp"]["mfu"])["result"]["ddp"]
    cases = {c["k"]: c for c in fp8["data"]["cases"]}
    wins = [k for k in sorted(cases) if cases[k]["layer_speedup_compiled"] > 1]
    largest = max(cases)
    cpu = async_cpu["data"]
    digests = resume["data"]["state_digests"]
    same = "the same" if digests["uninterrupted"] == digests["resumed"] else "a different"
    rows = [
        ("Does the trainer reach 40% MFU on one GPU?",
         f"{best['ddp']['mfu']:.1%} MFU, {best['ddp']['tokens_per_s']:,.0f} tokens/s at GPT-2 small's shape, "
         f"{best['global_batch_size']} sequences per step", _where(small), "#gpt-2-smalls-shape"),
        ("What moved MFU most?",
         f"compiling the loss: {blocks['tokens_per_s']:,.0f} → {loss['tokens_per_s']:,.0f} tokens/s "
         f"(+{loss['tokens_per_s'] / blocks['tokens_per_s'] - 1:.0%}), peak {blocks['peak_memory_gib']:.2f} → "
         f"{loss['peak_memory_gib']:.2f} GiB", _where(small), "#gpt-2-smalls-shape"),
        ("The benchmark's own 219 M model, best run",
         f"{top['mfu']:.1%} MFU, {top['tokens_per_s']:,.0f} tokens/s", _where(big), "#gpu"),
        ("What does an asynchronous checkpoint cost training?",
         f"{stall['blocked_s']:.2f} s blocked against {stall['sync_s']:.2f} s for a synchronous save "
         f"({stall['blocked_floor_ratio']:.2f}x a plain copy into host buffers)", _where(small),
         "#async-checkpoint-stall"),
        ("The same on CPU (FSDP, 2 ranks on gloo)",
         f"{cpu['blocked_s']:.3f} s blocked against {cpu['sync_s']:.3f} s synchronous "
         f"({cpu['params'] / 1e6:.1f} M parameters)", _where(async_cpu), "#async-checkpoint-stall"),
        ("When does FP8 pay?",
         f"compiled, from K = {wins[0]:,} ({cases[wins[0]]['layer_speedup_compiled']:.2f}x; "
         f"{cases[largest]['layer_speedup_compiled']:.2f}x at {largest:,}); eager never "
         f"({cases[largest]['layer_speedup']:.2f}x at {largest:,})", _where(fp8), "#where-fp8-pays"),
        ("Does a SIGKILLed run resume exactly?",
         f"{same} state digest as the uninterrupted run, {resume['data']['world_size']} ranks, killed at step "
         f"{resume['data']['fail_at_step']}, restored from step {resume['data']['restored_step']}",
         _where(resume), "../reliability/checkpointing.md#what-a-resume-test-proves"),
    ]
    lines = ["| Question | Measured answer | Run |", "| --- | --- | --- |"]
    lines += [f"| [{q}]({link}) | {a} | {w} |" for q, a, w, link in rows]
    return "\n".join(lines) + "\n"


def goodput() -> str:
    """Each `bench goodput` run of `docs/data/goodput.json`: its costs, its failures, and goodput
    measured against `calc.goodput`'s prediction from those costs."""
    record = _record("goodput")
    rows = ["| Save every | τ (s) | C (s) | R (s) | M (s) | Failures: compute/save/restore | Goodput, measured "
            "| Goodput, model | Training kept, measured / model | Final state |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in record["data"]["runs"]:
        r = run["result"]
        rows.append(f"| {r['checkpoint_every']} steps | {r['interval_s']:.3f} | {r['save_s']:.3f} | {r['restart_s']:.1f} "
                    f"| {r['job_mtbf_s']:.2f} | {r['failures']}: {r['failures_computing']}/{r['failures_saving']}/"
                    f"{r['failures_restoring']} | {r['measured_goodput']:.3f} | {r['predicted_goodput']:.3f} "
                    f"| {r['measured_goodput'] / (1 - r['measured_restart_fraction']):.3f} / "
                    f"{r['predicted_goodput'] / (1 - r['predicted_restart_fraction']):.3f} "
                    f"| {'as uninterrupted' if r['digest_equal'] else 'DIFFERS'} |")
    commands = "; ".join(f"`{run['command']}`" for run in record["data"]["runs"])
    rows.append(f"\nτ: interval between saves, C: save, R: restart per failure, M: the job's measured mean time "
                f"between failures while computing or saving. Training kept: the share of the time spent computing and saving "
                f"that ended as kept steps. {record['data']['note']} torch {record['torch']}, {record['device']}, {record['date']}, "
                f"commit {record['commit']}. Runs: {commands}.")
    return '<div class="handbook-compact" markdown>\n\n' + "\n".join(rows[:-1]) + "\n\n</div>\n" + rows[-1]


def memory_grid() -> str:
    """The grid at Llama-2 and Llama-3 shapes (`docs/data/memory_grid.json`)."""
    return _memory_grid("memory_grid")


def memory_grid_reduced() -> str:
    """The test suite's reduced grid (`docs/data/memory_grid_reduced.json`)."""
    return _memory_grid("memory_grid_reduced")


def accessibility_known() -> str:
    """Each axe rule the browser test lets pass on a theme element, where, and why it stays."""
    rules = json.loads((DATA / "accessibility_known.json").read_text(encoding="utf-8"))["rules"]
    rows = [f"| `{rule}` | {known['element']} (`{known['selector']}`) | {known['reason']} |"
            for rule, known in rules.items()]
    return "\n".join(["| axe rule | Where | Why it stays |", "| --- | --- | --- |", *rows]) + "\n"


TABLES: dict[str, Callable[[], str]] = {"mesh_ranking": mesh_ranking, "mesh_landmarks": mesh_landmarks,
                                        "memory_grid": memory_grid, "memory_grid_reduced": memory_grid_reduced,
                                        "pipeline_bubble": pipeline_bubble, "gpu": gpu, "gpu_ladder": gpu_ladder,
                                        "gpu_small": gpu_small, "gpu_fp8": gpu_fp8, "gpu_host_bound": gpu_host_bound,
                                        "accessibility_known": accessibility_known,
                                        "benchmark_summary": benchmark_summary, "goodput": goodput}


def table(name: str) -> str:
    """The Markdown table that replaces `<!-- table: name -->`.

    Raises:
        ValueError: No table has that name.
    """
    if name not in TABLES:
        raise ValueError(f"<!-- table: {name} -->: no such table (known: {', '.join(TABLES)})")
    return TABLES[name]()


def _indented_table(m: re.Match[str]) -> str:
    """The table for a marker, every line indented as the marker is (a marker inside a
    "How we know" fold gives a table inside the fold)."""
    start = m.string.rfind("\n", 0, m.start()) + 1
    indent = m.string[start:m.start()]
    if indent.strip():
        indent = ""  # the marker follows text on its line: indent nothing
    return f"\n{indent}".join(table(m["name"]).split("\n"))


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Replace each `<!-- table: NAME -->` with its computed table."""
    return MARK.sub(_indented_table, markdown)
