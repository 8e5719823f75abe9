"""Failures and checkpoints: the checkpoint interval that maximises goodput, and goodput itself."""

from __future__ import annotations

import math

from reference_impl.calc.checks import count, non_negative, positive

# Above this many MTBFs the failure model's exponentials overflow a double; such a job
# would practically never finish between failures anyway.
_MAX_COST_OVER_MTBF = 100.0


def checkpoint_interval(*, checkpoint_cost_s: float, mtbf_s: float,
                        restart_s: float = 0.0) -> dict[str, float]:
    """Optimum compute time between checkpoints: Young's first order and Daly's higher order.

    Young (CACM 1974): `tau = sqrt(2 C M)` for a blocking save cost `C` and a job mean
    time between failures `M`, with overhead `C / tau + tau / (2 M)` (saving plus the
    expected recomputation), about `sqrt(2 C / M)` at the optimum. Daly (FGCS 2006, eq. 37):
    `tau = sqrt(2 C M) (1 + sqrt(C / (2 M)) / 3 + C / (2 M) / 9) - C` while `C < 2 M`, else
    `tau = M`. Daly's complete model, with exponentially distributed failures and a
    restart time `R`, expects a wall time of `M e^(R/M) (e^((tau + C)/M) - 1) / tau` per
    unit of work; `daly_overhead_fraction` is that minus 1 at Daly's interval.

    Args:
        checkpoint_cost_s: Seconds a save blocks training (C).
        mtbf_s: Mean time between failures of the whole job in seconds (M).
        restart_s: Seconds from a failure to training again (R); only Daly's model uses it.

    Returns:
        `young_interval_s`, `young_overhead_fraction`, `daly_interval_s` and
        `daly_overhead_fraction`.

    Raises:
        ValueError: A non-positive cost or MTBF, a negative restart time, or a cost or
            restart time above 100 MTBFs.
    """
    c, m = positive("checkpoint_cost_s", checkpoint_cost_s), positive("mtbf_s", mtbf_s)
    r = non_negative("restart_s", restart_s)
    if max(c, r) > _MAX_COST_OVER_MTBF * m:
        raise ValueError(f"checkpoint_cost_s and restart_s must not exceed {_MAX_COST_OVER_MTBF:g} x mtbf_s")
    young = math.sqrt(2 * c * m)
    ratio = c / (2 * m)
    daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c if c < 2 * m else m
    daly_overhead = m * math.exp(r / m) * math.expm1((daly + c) / m) / daly - 1
    return {"young_interval_s": young, "young_overhead_fraction": c / young + young / (2 * m),
            "daly_interval_s": daly, "daly_overhead_fraction": daly_overhead}


def _exp_minus_one_minus_x(x: float) -> float:
    """`e^x - 1 - x` without the cancellation of `expm1(x) - x` near 0 (a series below |x| 0.5)."""
    if abs(x) >= 0.5:
        return math.expm1(x) - x
    term, total = x * x / 2, 0.0
    for k in range(3, 40):
        total += term
        term *= x / k
        if abs(term) <= 1e-17 * abs(total):
            break
    return total


def _optimal_work_over_mtbf(c: float) -> float:
    """The `y = lambda tau` that minimises `(e^(y + c) - 1) / y`, for `c = lambda C > 0`.

    Setting the derivative to zero gives `(1 - y) e^(y + c) = 1`; with `z = -ln(1 - y)` that
    is `g(z) = e^(-z) - 1 + z - c = 0`, increasing and convex in `z`, so Newton's method from
    a point right of the root walks down to it without overshooting. `z = 2 sqrt(c)` lies
    right of it while `c <= 0.5` (`g(z) >= z^2/2 - z^3/6`), `z = c + 1` always. Solved in `z`,
    the answer stays exact where `y` rounds to 1 (large `c`).
    """
    z = 2 * math.sqrt(c) if c <= 0.5 else c + 1
    for _ in range(100):
        step = (_exp_minus_one_minus_x(-z) - c) / -math.expm1(-z)
        if not step > 1e-16 * z:
            break
        z -= step
    return -math.expm1(-z)


def goodput(*, n_gpus: int, mtbf_gpu_hours: float, save_s: float, restart_s: float,
            interval_s: float | None = None) -> dict[str, float]:
    """Productive share of wall time for a job that checkpoints, fails and restarts.

    The process: the job computes for `interval_s` (tau), then a save blocks it for `save_s`
    (C), and so on. Failures arrive as a Poisson process at rate `lambda = n_gpus /
    mtbf_gpu_hours` (per hour; the job's MTBF is `M = 1 / lambda`) while the job computes or
    saves, never while it restarts. A failure loses everything since the last completed save
    (a save it interrupts included) and costs `restart_s` (R), after which the job resumes
    from that save.

    Expected value, exactly, by renewal-reward: cut wall time into cycles, each ending when a
    save completes; every cycle earns `tau` of kept work. A cycle tries `T = tau + C` of
    uninterrupted time; a try survives with probability `p = e^(-lambda T)`, so the number of
    failures before the success is geometric with mean `N = e^(lambda T) - 1`. A failed try
    lasts on average `E[X | X < T] = 1/lambda - T p / (1 - p)` and adds R; solving
    `E = p T + (1 - p)(E[X | X < T] + R + E)` gives the expected cycle length
    `E = (1/lambda + R)(e^(lambda T) - 1)`. The long-run shares of wall time are then
    `goodput = tau / E`, `save_fraction = C / E` (completed saves), `restart_fraction =
    N R / E` and `lost_fraction = (N / lambda - T) / E` (work and partial saves undone);
    they sum to 1. Daly's complete model (`checkpoint_interval`) lets failures strike
    during restarts too and has `e^(R/M)` where this has `1 + R/M`.

    With `interval_s=None` the interval is this model's optimum: `y = lambda tau` solving
    `(1 - y) e^(y + lambda C) = 1`, which Young's `sqrt(2 C M)` and Daly's higher-order
    formula approximate (the factor in R does not depend on tau, so Daly's model has the
    same optimum); both are returned beside it.

    Args:
        n_gpus: GPUs in the job; each fails independently.
        mtbf_gpu_hours: Mean time between failures of one GPU, with its share of the host,
            network and software failures, in hours (`M = mtbf_gpu_hours / n_gpus` hours).
        save_s: Seconds a checkpoint blocks training (C).
        restart_s: Seconds from a failure until training resumes (R): detection, rescheduling,
            start-up, restore.
        interval_s: Seconds of training between saves (tau); `None` for the optimum.

    Returns:
        `goodput` (productive share of wall time), `save_fraction`, `lost_fraction`,
        `restart_fraction`, `interval_s` (as given, or the optimum), `optimal_interval_s`,
        `optimal_goodput`, `young_interval_s`, `daly_interval_s`, `job_mtbf_s`,
        `failures_per_day` (of the job) and `failures_per_checkpoint` (N, per completed save).

    Raises:
        ValueError: A GPU count below 1, a non-positive MTBF, save cost or interval, a negative
            restart time, or a save, restart or interval above 100 job MTBFs.
    """
    n = count("n_gpus", n_gpus)
    mtbf = positive("mtbf_gpu_hours", mtbf_gpu_hours) * 3600 / n
    c, r = positive("save_s", save_s), non_negative("restart_s", restart_s)
    tau = None if interval_s is None else positive("interval_s", interval_s)
    if max(c, r, tau or 0) > _MAX_COST_OVER_MTBF * mtbf:
        raise ValueError(f"save_s, restart_s and interval_s must not exceed {_MAX_COST_OVER_MTBF:g} x the job's "
                         "MTBF (mtbf_gpu_hours x 3600 / n_gpus)")
    rate = 1 / mtbf
    best = _optimal_work_over_mtbf(c * rate) * mtbf
    tau = best if tau is None else tau

    def shares(work: float) -> tuple[float, float, float, float, float]:
        failures = math.expm1(rate * (work + c))
        cycle = (mtbf + r) * failures
        lost = _exp_minus_one_minus_x(rate * (work + c)) * mtbf
        return work / cycle, c / cycle, lost / cycle, failures * r / cycle, failures

    kept, saving, lost, restarting, failures = shares(tau)
    young = math.sqrt(2 * c * mtbf)
    ratio = c / (2 * mtbf)
    return {"goodput": kept, "save_fraction": saving, "lost_fraction": lost, "restart_fraction": restarting,
            "interval_s": tau, "optimal_interval_s": best, "optimal_goodput": shares(best)[0],
            "young_interval_s": young,
            "daly_interval_s": young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c if c < 2 * mtbf else mtbf,
            "job_mtbf_s": mtbf, "failures_per_day": 86400 / mtbf, "failures_per_checkpoint": failures}
