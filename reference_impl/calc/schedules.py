"""`pipeline_bubble`: the idle share of a pipeline-parallel step, per schedule family."""

from __future__ import annotations

from reference_impl.calc.checks import count

# Pipeline schedule families with one bubble formula each (`pipeline_bubble`).
PIPELINE_SCHEDULES = ("1f1b", "zero_bubble", "zbv")


def pipeline_bubble(*, stages: int, microbatches: int, interleave: int = 1,
                    schedule: str = "1f1b") -> dict[str, float]:
    """Idle share of a pipeline-parallel step, for the schedules `torch.distributed.pipelining` ships.

    Time is counted in units of one forward of one model chunk; the backward for inputs
    (I) and for weights (W) take one unit each, so a full backward is two (the zero-bubble
    paper's assumption). With `p` stages, `m` micro-batches and `v` chunks per stage:

    - `"1f1b"` (GPipe, 1F1B, interleaved 1F1B, looped BFS): the bubble is `p - 1` slots
      of a chunk's forward and backward, `(p - 1) / (v m + p - 1)` of the step
      (Narayanan et al., SC 2021); `v` divides the bubble's duration.
    - `"zero_bubble"` (interleaved zero bubble, ZB1P of Qi et al., ICLR 2024): weight
      backwards fill the warm-up and cool-down, leaving `p - 1` units:
      `(p - 1) / (3 v m + p - 1)`.
    - `"zbv"` (ZBV zero bubble and DualPipeV: two chunks per stage in a V, `v` = 2):
      `b / (6 m + b)` with `b = max(p - 1, 2 (2 p - 1 - m))` idle units: with fewer than
      about `1.5 p` micro-batches the V cannot fill and each missing one costs two units.

    These are not approximations: they equal a replay of the action order each shipped
    schedule builds, with unit-time actions and free transfers, on every grid point of
    `tests/test_traces_certified.py`. Assumes equal stage times and ignores the
    point-to-point transfers.

    Args:
        stages: Pipeline stages p.
        microbatches: Micro-batches m per step.
        interleave: Model chunks v per stage (1: no interleaving). An interleaved
            schedule and `"zero_bubble"` need `m` to be a multiple of `p` (below `p`
            micro-batches torch's zero-bubble schedule idles more than the formula);
            `"zbv"` needs `v` = 2.
        schedule: `"1f1b"` (the default), `"zero_bubble"` or `"zbv"`.

    Returns:
        `bubble_fraction` (of the step), `bubble_over_ideal` (of the ideal compute time)
        and `efficiency` (1 - bubble_fraction).

    Raises:
        ValueError: A count below 1, an unknown schedule, interleaving or `"zero_bubble"`
            with `m` not a multiple of `p`, or `"zbv"` with `v` other than 2.
    """
    p, m = count("stages", stages), count("microbatches", microbatches)
    v = count("interleave", interleave)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
    if schedule == "zbv" and v != 2:
        raise ValueError(f"the zbv schedule runs 2 chunks per stage: interleave must be 2, got {v}")
    if schedule == "zero_bubble" and m % p:
        raise ValueError(f"the zero_bubble schedule needs microbatches ({m}) to be a multiple of stages ({p})")
    if schedule == "1f1b" and v > 1 and m % p:
        raise ValueError(f"an interleaved schedule needs microbatches ({m}) to be a multiple of stages ({p})")
    # Idle and busy time per stage: for "1f1b" in slots of a chunk's forward and backward
    # (today's formula, unchanged), for the zero-bubble schedules in units of a forward.
    if schedule == "1f1b":
        idle, busy = p - 1, v * m
    elif schedule == "zero_bubble":
        idle, busy = p - 1, 3 * v * m
    else:
        idle, busy = max(p - 1, 2 * (2 * p - 1 - m)), 6 * m
    bubble = idle / (busy + idle)
    return {"bubble_fraction": bubble, "bubble_over_ideal": idle / busy, "efficiency": 1 - bubble}
