"""The benchmark command line: each benchmark reports what it measured in the run it was
asked for, with its ratios computed against the baseline measured in the same run.

No timing is asserted (the machine is shared); relations that hold whatever the timings
are: ratio = ours / baseline from the reported values, medians of the reported rounds,
an async save's total never shorter than the time it blocked, sizes that match the model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import statistics
import sys
from pathlib import Path

import launch
import pytest
import torch

from reference_impl.bench import BENCHMARKS, BenchmarkError, goodput, recovery_times
from reference_impl.bench import main as bench_main
from reference_impl.bench.common import median_interval
from reference_impl.bench.goodput import FaultyRun, Kill, account
from reference_impl.config import TrainConfig
from reference_impl.model import build_model

# Reported seconds and milliseconds are rounded to this many decimals.
ROUNDING = 5e-5


def last_json(run: launch.Run, name: str) -> dict:
    """The benchmark's final JSON line, after checking the run succeeded."""
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == name
    return result


def bench_config(name: str, flags: list[str], world_size: int = 1) -> TrainConfig:
    """The config a benchmark runs: its own defaults, then the test's flags."""
    return TrainConfig.from_cli([*BENCHMARKS[name].train_defaults, *flags], {"WORLD_SIZE": str(world_size)})


def assert_ratio(ratio: float, ours: float, baseline: float, rounding: float = ROUNDING) -> None:
    """`ratio` is ours / baseline, up to the rounding of the three reported numbers."""
    assert ours >= 0 and baseline > rounding, (ours, baseline)
    low, high = (ours - rounding) / (baseline + rounding), (ours + rounding) / (baseline - rounding)
    assert low - ROUNDING <= ratio <= high + ROUNDING, (ratio, ours, baseline)


OVERHEAD_FLAGS = ["--max-steps", "3", "--hidden-dim", "16", "--micro-batch-size", "8", "--dataset-size", "64"]


def test_overhead_bench_reports_trainer_over_bare_loop_for_the_requested_run() -> None:
    run = launch.python_module(["overhead", "--rounds", "2", "--tiny-steps", "5", *OVERHEAD_FLAGS],
                               timeout=60, module="reference_impl.bench")
    result = last_json(run, "overhead")
    cfg = bench_config("overhead", OVERHEAD_FLAGS)
    assert result["config_digest"] == cfg.digest(), "the benchmark ran the configured loop"
    assert (result["model"], result["micro_batch_size"], result["steps"]) == ("mlp", 8, 3)
    assert result["rounds"] == 2 and result["threads"] == 1 and result["tiny_steps"] == 5
    assert_ratio(result["ratio"], result["trainer_ms_per_step"], result["bare_ms_per_step"])
    assert result["ratio_min"] <= result["ratio_max"], "the spread of the per-round ratios"
    # Two rounds are too few for a 95% interval: it is their whole range.
    assert result["ratio_ci"] == [result["ratio_min"], result["ratio_max"]]
    assert result["ratio_min"] <= result["ratio_per_round"] <= result["ratio_max"]
    assert result["fixed_us_ci"] == [result["fixed_us_min"], result["fixed_us_max"]]
    assert result["cpu_ratio"] > 0
    assert result["fixed_us_min"] <= result["fixed_us_per_step"] <= result["fixed_us_max"]


def test_the_median_interval_covers_the_median_as_often_as_it_claims() -> None:
    """31 rounds: the 10th smallest to the 10th largest (97.1% by the binomial tail). Drawn
    from a lopsided distribution whose median is known, it misses about 3% of the time; an
    interval one rank narrower on each side would miss about 7%."""
    assert median_interval([float(v) for v in range(31)]) == (9.0, 21.0)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0), "too few values for 95%: the whole range"
    rng, true_median, trials = random.Random(0), math.log(2), 2000
    covered = sum(low <= true_median <= high for low, high in
                  (median_interval([rng.expovariate(1.0) for _ in range(31)]) for _ in range(trials)))
    assert 0.95 <= covered / trials <= 0.99


@pytest.mark.parametrize("argv,message", [
    (["overhead", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["overhead", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["overhead", "--tiny-steps", "-1"], "argument --tiny-steps: must be at least 0, got -1"),
    (["checkpoint", "--hidden-dims", "4096,0"], "argument --hidden-dims: must be at least 1, got 0"),
    (["checkpoint", "--hidden-dims", ","], "argument --hidden-dims: needs at least one number"),
    (["pipeline", "--microbatches", "x"], "argument --microbatches: invalid int_list value: 'x'"),
    (["async", "--nproc", "0"], "argument --nproc: must be at least 1, got 0"),
    (["peers", "--checkpoint-hidden-dim", "-5"], "argument --checkpoint-hidden-dim: must be at least 1, got -5"),
    (["fp8", "--iters", "0"], "argument --iters: must be at least 1, got 0"),
])
def test_a_bad_count_is_one_line_and_exit_status_2(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Rounds, threads, sizes and process counts are checked where they are parsed: before,
    `--rounds 0` ran the benchmark and ended in a StatisticsError traceback."""
    with pytest.raises(SystemExit) as exit_info:
        bench_main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"python -m reference_impl.bench {argv[0]}: error: {message}"


@pytest.mark.parametrize("flags", [["--checkpoint-dir", "CKPT"], ["--sample-log", "CKPT"], ["--fail-at-step", "1"]])
def test_a_benchmark_refuses_to_touch_a_real_runs_files_or_kill_itself(
        flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench overhead --checkpoint-dir D` used to restore, prune and write D's checkpoints
    without its lock, and time loops that trained nothing; `--fail-at-step` SIGKILLed it."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-00000002").mkdir()
    argv = ["overhead", "--rounds", "1", "--tiny-steps", "0", *[str(ckpt) if f == "CKPT" else f for f in flags]]
    assert bench_main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"reference_impl.bench overhead: error: {flags[0]}: benchmarks write only to scratch "
                    "directories of their own and run every loop to the end")
    assert [p.name for p in ckpt.iterdir()] == ["step-00000002"]


@pytest.mark.parametrize("argv,message", [
    (["pipeline", "--microbatches", "1"], "every --microbatches value must be at least the number of stages (2)"),
    (["pipeline", "--microbatches", "4,6,3"], "every --microbatches value must be a multiple of the number of stages (2)"),
    (["async", "--strategy", "ddp"], "async checkpoints are FSDP-only (--strategy fsdp)"),
    (["ft", "--step-floor-s", "-1"], "--step-floor-s must be in [0, 60]"),
])
def test_a_benchmarks_own_refusal_comes_from_the_launcher_before_torchrun(
        argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Checked on the ranks only, it ended in torchrun's ChildFailedError traceback and exit 1."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("torchrun was started"))
    assert bench_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"reference_impl.bench {argv[0]}: error: {message}"]


def test_overhead_refuses_a_tiny_model_run_it_cannot_build_before_measuring(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--tiny-steps 2` with 5 warm-up steps is refused at once, not after the main measurement."""
    from reference_impl.bench import overhead

    monkeypatch.setattr(overhead, "_compare", lambda *a: pytest.fail("measured before refusing"))
    assert bench_main(["overhead", "--warmup-steps", "5", "--max-steps", "5", "--tiny-steps", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "reference_impl.bench overhead: error: warmup_steps (5) must not exceed max_steps (2)")


def test_more_processes_than_gpus_is_refused_before_torchrun_starts(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`bench gpu --nproc 2` on a one-GPU node: one line from the launcher, not one per rank."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench_main(["gpu", "--nproc", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "reference_impl.bench gpu: error: 2 ranks on this node but 1 GPU(s) visible: each rank needs a GPU "
        "of its own; start at most 1 per node, or pass --device cpu"]


COMPILE_FLAGS = ["--max-steps", "3", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--hidden-dim", "64",
                 "--seq-len", "16", "--vocab-size", "64", "--dataset-size", "64"]


@pytest.mark.slow
def test_compile_bench_reports_the_speed_up_and_two_graphs_without_breaks() -> None:
    run = launch.python_module(["compile", "--rounds", "1", *COMPILE_FLAGS], timeout=240,
                               module="reference_impl.bench")
    result = last_json(run, "compile")
    assert result["config_digest"] == bench_config("compile", COMPILE_FLAGS).digest()
    assert_ratio(result["speedup"], result["eager_ms_per_step"], result["compiled_ms_per_step"])
    assert result["speedup_min"] <= result["speedup"] <= result["speedup_max"]
    assert (result["graph_breaks"], result["unique_graphs"]) == (0, 2), "one graph serves both blocks, one the loss"


@pytest.mark.slow
def test_checkpoint_bench_reports_each_size_against_raw_torch_save_and_a_restart() -> None:
    hidden_dims, rounds = [16, 32], 2
    run = launch.python_module(["checkpoint", "--rounds", str(rounds), "--hidden-dims", "16,32"],
                               timeout=180, module="reference_impl.bench")
    result = last_json(run, "checkpoint")
    cfg = bench_config("checkpoint", [])
    assert result["config_digest"] == cfg.digest() and result["rounds"] == rounds
    assert [s["hidden_dim"] for s in result["sizes"]] == hidden_dims
    for size in result["sizes"]:
        model = build_model(dataclasses.replace(cfg, hidden_dim=size["hidden_dim"]))
        params = sum(p.numel() for p in model.parameters())
        assert size["params"] == params
        assert size["state_bytes"] >= 3 * 4 * params, "fp32 weights and AdamW's two moments"
        for key in ("save_ours_s", "save_raw_s", "save_raw_fsync_s", "save_floor_s", "restore_ours_s", "restore_raw_s"):
            assert size[key] >= 0, key
            assert len(size[f"{key}_all"]) == rounds, "every round is reported"
            assert size[key] == pytest.approx(statistics.median(size[f"{key}_all"]), abs=1e-4), key
        assert size["checkpoint_bytes"] >= size["state_bytes"], "the floor writes what our checkpoint holds"
        assert size["floor_method"] in ("O_DIRECT", "buffered")
        assert_ratio(size["save_ratio"], size["save_ours_s"], size["save_raw_s"])
        assert_ratio(size["save_ratio_fsync"], size["save_ours_s"], size["save_raw_fsync_s"])
        assert_ratio(size["save_floor_ratio"], size["save_ours_s"], size["save_floor_s"])
        assert_ratio(size["restore_ratio"], size["restore_ours_s"], size["restore_raw_s"])
        # Every round is reported to the microsecond, so the best-round ratios are checked closely.
        fastest = {case: min(size[f"save_{case}_s_all"]) for case in ("ours", "raw_fsync", "floor")}
        assert_ratio(size["best_save_ratio_fsync"], fastest["ours"], fastest["raw_fsync"], rounding=5e-7)
        assert_ratio(size["best_save_floor_ratio"], fastest["ours"], fastest["floor"], rounding=5e-7)
    for key in ("save_ratio", "save_ratio_fsync", "save_floor_ratio", "restore_ratio"):
        assert result[f"max_{key}"] == max(s[key] for s in result["sizes"])
    assert len(result["recovery_s_all"]) == rounds
    assert result["recovery_s"] == pytest.approx(statistics.median(result["recovery_s_all"]), abs=1e-3)
    assert 0 < result["recovery_restored_s"] <= result["recovery_s"], "restored before the first resumed step"
    assert len(result["recovery_floor_s_all"]) == rounds and result["recovery_floor_s"] > 0
    # Recovery seconds are reported to 3 decimals, the ratio to 4.
    assert_ratio(result["recovery_floor_ratio"], result["recovery_s"], result["recovery_floor_s"], rounding=5e-4)
    assert all(d > g for d, g in zip(result["recovery_ddp_floor_s_all"], result["recovery_floor_s_all"],
                                     strict=True)), "the DDP floor comes after the group floor, run by run"
    assert_ratio(result["recovery_ddp_floor_ratio"], result["recovery_s"], result["recovery_ddp_floor_s"],
                 rounding=5e-4)
    assert result["raw_save_fsync"] is False


@pytest.mark.slow
def test_checkpoint_bench_ends_with_its_json_line_without_torchruns_shared_store() -> None:
    """With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun's agent serves no store and rank 0
    hosts one: the restart floor's script was a client of a store nobody served, with no
    bound on the wait, and the benchmark did not end within 15 minutes."""
    run = launch.python_module(["checkpoint", "--rounds", "1", "--hidden-dims", "16"], timeout=300,
                               module="reference_impl.bench", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    result = last_json(run, "checkpoint")
    assert result["recovery_s"] > 0 and result["recovery_floor_s"] > 0 and result["recovery_floor_ratio"] > 0


ASYNC_FLAGS = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64"]


@pytest.mark.slow
def test_async_bench_relaunches_under_torchrun_and_compares_with_a_sync_save() -> None:
    run = launch.python_module(["async", "--rounds", "1", *ASYNC_FLAGS],
                               timeout=180, module="reference_impl.bench")
    result = last_json(run, "async")
    cfg = bench_config("async", ASYNC_FLAGS, world_size=2)
    assert result["world_size"] == 2 and result["config_digest"] == cfg.digest()
    assert result["params"] == sum(p.numel() for p in build_model(cfg).parameters()), "global, not per shard"
    assert result["sync_s"] > 0 and result["blocked_s"] > 0
    assert result["async_total_s"] >= result["blocked_s"], "the async save finishes after it returns"
    assert_ratio(result["blocked_ratio"], result["blocked_s"], result["sync_s"])
    # The floor: a copy of the rank's state into preallocated buffers, microseconds at this
    # size, so its rounded value may be 0; the ratio is taken before rounding.
    assert result["floor_s"] >= 0 and result["blocked_floor_ratio"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_ft_bench_compares_its_own_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The ratio is the full restart's stall over the survivors' pause, both medians of this run's rounds."""
    replica_runs = iter([{"kill_to_survivor_step_s": 2.0, "kill_to_contributing_s": 9.0, "outage_steps": 80,
                          "samples_not_trained": 640},
                         {"kill_to_survivor_step_s": 4.0, "kill_to_contributing_s": 11.0, "outage_steps": 90,
                          "samples_not_trained": 720}])
    restarts = iter([(7.0, 8.0), (9.0, 16.0)])
    monkeypatch.setattr("reference_impl.bench.ft.replica_run", lambda steps, floor: next(replica_runs))
    monkeypatch.setattr("reference_impl.bench.ft.recovery_run", lambda: next(restarts))
    assert bench_main(["ft", "--rounds", "2"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["benchmark"] == "ft"
    assert (line["survivor_step_s"], line["rejoin_s"], line["full_restart_resumed_s"]) == (3.0, 10.0, 12.0)
    assert line["stall_ratio"] == 4.0 and line["outage_steps"] == [80, 90]


def test_gpu_bench_refuses_without_a_gpu() -> None:
    run = launch.python_module(["gpu"], timeout=60, module="reference_impl.bench")
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "reference_impl.bench gpu: error: --device cuda was requested but no GPU is visible"]


def test_recovery_times_from_events() -> None:
    events = [{"event": "run_start", "restart_count": 0, "time": 100.0},
              {"event": "step", "step": 14, "time": 101.0},
              {"event": "error", "time": 101.5},
              {"event": "run_start", "restart_count": 1, "time": 102.5},
              {"event": "checkpoint_restored", "restart_count": 1, "step": 10, "time": 103.0},
              {"event": "step", "step": 11, "time": 103.25}]
    assert recovery_times(events) == (2.0, 2.25)
    with pytest.raises(BenchmarkError, match="did not show a kill"):
        recovery_times(events[:3])


def test_the_relaunch_under_torchrun_passes_a_command_line_torchrun_accepts() -> None:
    """torchrun's parser also scans the module's arguments and rejects `--nproc` there (an
    ambiguous abbreviation of its `--nproc-per-node`): the launcher must not pass it on."""
    from torch.distributed.run import get_args_parser

    from reference_impl.bench import _without_launcher_flags
    from reference_impl.launch import torchrun_command

    argv = ["gpu", "--nproc", "1", "--rounds", "1", "--nproc=1", "--launch-timeout-s", "9", "--compile",
            "--launch-timeout-s=9"]
    command = torchrun_command(1, "reference_impl.bench", _without_launcher_flags(argv))
    parsed = get_args_parser().parse_args(command[3:])  # after `python -m torch.distributed.run`
    assert parsed.training_script_args == ["gpu", "--rounds", "1", "--compile"]


@pytest.mark.timeout(180)
def test_a_relaunched_job_past_its_deadline_is_killed_and_ends_in_one_line() -> None:
    """`bench async` relaunches itself under torchrun; with a deadline shorter than its ranks
    take to start, the launcher kills the job and every process it started, and says so in
    one line (no traceback, no rank left behind)."""
    marker = "917263"  # a seed no other job uses: finds the job's processes in /proc
    run = launch.python_module(["async", "--launch-timeout-s", "1", "--rounds", "1", "--seed", marker],
                               timeout=150, module="reference_impl.bench")
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == ("reference_impl.bench async: failed: the torchrun job did not "
                                                   "end within --launch-timeout-s 1; it and every process it "
                                                   "started were killed"), run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    left = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if b"reference_impl.bench" in argv and marker.encode() in argv:
            left.append(entry.name)
    assert not left, f"processes of the killed job still run: {left}"


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is not None and importlib.util.find_spec("lightning")
                    is not None, reason="checks the message an install without the peers extra gets")
def test_peers_bench_names_the_extra_it_needs() -> None:
    run = launch.python_module(["peers"], timeout=60, module="reference_impl.bench")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("reference_impl.bench peers: error: peers needs ")
    assert run.stderr.strip().endswith("pip install -e '.[peers]'")


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("lightning") is None,
                    reason="needs the peers extra (pip install -e '.[peers]')")
def test_peers_bench_observes_the_guarantees_of_each_save(tmp_path) -> None:
    """Ours keeps all three; raw torch.save none (the control that shows the probe can fail)."""
    from reference_impl.bench.peers import guarantees, savers
    from reference_impl.bench.common import trained_state
    from reference_impl.config import TrainConfig
    from reference_impl.distributed import DistContext

    cfg = TrainConfig(max_steps=2, warmup_steps=0)
    found = {name: guarantees(s, tmp_path) for name, s in savers(trained_state(cfg, DistContext()), cfg).items()}
    assert found["ours"] == {"fsync": True, "atomic": True, "verified": True}
    assert found["raw"] == {"fsync": False, "atomic": False, "verified": False}


def test_fp8_bench_reports_each_size_with_ratios_from_its_own_timings() -> None:
    """On a CPU the fp8 matmul is an emulation: the report runs and says so, and makes no
    speed claim; the ratios are bf16 / fp8 of the same run's medians."""
    run = launch.python_module(["fp8", "--sizes", "16,32", "--tokens", "32", "--iters", "1", "--rounds", "1"],
                               timeout=120, module="reference_impl.bench")
    result = last_json(run, "fp8")
    assert result["device"].startswith("cpu (emulated")
    assert [c["k"] for c in result["cases"]] == [16, 32]
    for case in result["cases"]:
        ms = case["ms"]
        assert_ratio(case["matmul_speedup"], ms["matmul bf16"], ms["matmul fp8"])
        assert_ratio(case["layer_speedup"], ms["layer bf16"], ms["layer fp8"])


def test_fp8_bench_refuses_a_size_the_gpu_kernel_cannot_take() -> None:
    run = launch.python_module(["fp8", "--sizes", "24"], timeout=60, module="reference_impl.bench")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == ("reference_impl.bench fp8: error: --tokens and every size must be "
                                                   "multiples of 16; --iters and --rounds at least 1")


def _event(name: str, t: float, **fields: object) -> dict:
    return {"event": name, "rank": 0, "time": t, **fields}


def test_goodput_accounting_cuts_wall_time_four_ways() -> None:
    """Saves every 2 steps. Attempt 0 starts with nothing to restore, saves step 2 and is killed
    inside the save of step 4; attempt 1 is killed inside its restore; attempt 2 restores step 2
    and finishes. Kept: steps 1-2 and 3-4 (1 s each) and the saves of 2 and 4 (0.5 s each); lost:
    attempt 0's steps 3-4 and its partial save (4.7 - 2.5 s); restart: from the kill at 4.7 to
    attempt 2's restore at 20.5, the second kill inside it."""
    events = [_event("run_start", 0.0, restart_count=0), _event("step", 1.0, step=1), _event("step", 2.0, step=2),
              _event("checkpoint_saved", 2.5, step=2), _event("step", 3.5, step=3), _event("step", 4.5, step=4),
              _event("run_start", 10.0, restart_count=1),
              _event("run_start", 20.0, restart_count=2), _event("checkpoint_restored", 20.5, step=2),
              _event("step", 21.5, step=3), _event("step", 22.5, step=4), _event("checkpoint_saved", 23.0, step=4),
              {"event": "error", "rank": 1, "time": 4.8}, _event("run_complete", 23.2, step=4)]
    kills = [Kill(4.7, 0, 1, "up"), Kill(10.1, 1, 0, "restore")]
    # A kill that reached a rank of the attempt that went on to complete struck nothing: no failure.
    got = account(events, [*kills, Kill(23.3, 2, 1, "up")], every=2)
    assert (got.kept_s, got.save_s, got.lost_s, got.restart_s) == pytest.approx((4.0, 1.0, 2.2, 15.8))
    assert got.wall_s == pytest.approx(23.0) and got.up_s == pytest.approx(7.2) and got.up_failures == 1
    assert [k.during for k in kills] == ["save", "restore"] and got.kills == kills
    assert got.step_times == pytest.approx([1.0] * 6) and got.save_times == pytest.approx([0.5, 0.5])


def test_a_faulty_run_that_closes_its_output_but_lingers_ends_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for the launcher's exit is bounded too: before, it ended in a TimeoutExpired
    traceback instead of the benchmark's one line."""
    monkeypatch.setattr(goodput, "EXIT_GRACE_S", 0.5)
    lingering = [sys.executable, "-c", "import os, time; os.close(1); time.sleep(60)"]
    faulty = FaultyRun(lingering, 1.0, 0.0, random.Random(0), timeout_s=60, max_steps=1)
    with pytest.raises(BenchmarkError, match="closed its output but did not exit within 0.5 s after 0 kills"):
        faulty.run()  # the child sleeps a minute: only the bound can end the wait this soon


# The fault process's first draw is its first arrival, in MTBFs after the job starts: seed 31
# draws 0.0124, so the first kill comes 25 ms into a 2 s MTBF, long before the job can end on
# any machine (the run is sized from a calibration run to last about an MTBF or more). The
# arrivals after it are the Poisson process the benchmark always uses.
FIRST_KILL_SEED, GOODPUT_MTBF_S = 31, 2.0


@pytest.mark.slow
def test_goodput_bench_kills_ranks_and_loses_nothing() -> None:
    """SIGKILLs of random ranks (a restore hit half the time) under torchrun: the final state
    equals the uninterrupted run's, every failure is filed, and the shares of wall time add up.
    The seed makes the first kill certain (left to chance, a Poisson count with three expected
    is zero in one run of 20, which failed CI runs); one more is expected while the job computes. Every restart starts
    fresh interpreters, so the number of kills, not of steps, sets what the test costs."""
    assert random.Random(FIRST_KILL_SEED).expovariate(1 / GOODPUT_MTBF_S) < 0.02 * GOODPUT_MTBF_S
    run = launch.python_module(["goodput", "--failures", "1", "--mtbf-s", str(GOODPUT_MTBF_S),
                                "--restore-kills", "0.5", "--fault-seed", str(FIRST_KILL_SEED), "--timeout-s", "400"],
                               timeout=600, module="reference_impl.bench")
    result = last_json(run, "goodput")
    assert result["digest_equal"] is True and result["state_digest"] == result["reference_digest"]
    assert result["failures"] >= 1
    assert result["failures"] == result["failures_computing"] + result["failures_saving"] + \
        result["failures_restoring"]
    assert 0 < result["measured_goodput"] <= 1 and 0 < result["predicted_goodput"] <= 1
    shares = ("save_fraction", "lost_fraction", "restart_fraction")
    assert result["measured_goodput"] + sum(result[f"measured_{k}"] for k in shares) == pytest.approx(1, abs=1e-3)
    assert result["accounted_s"] <= result["wall_s"]
