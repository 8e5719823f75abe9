"""Throughput: model FLOPs utilisation of a measured step, and the step time an MFU predicts."""

from __future__ import annotations

from reference_impl.calc.checks import count, positive


def mfu(*, flops_per_sample: float, samples_per_step: float, step_time_s: float, n_gpus: int,
        peak_flops_per_gpu: float) -> dict[str, float]:
    """Model FLOPs utilisation of a measured step, and the step time at 100% MFU.

    `MFU = flops_per_sample x samples_per_step / step_time_s / (n_gpus x peak)`. The model
    FLOPs are what training needs, about `6 x parameters` per token for a dense
    transformer plus attention (`reference_impl.model.flops_per_sample`); recomputation
    by activation checkpointing is not counted.

    Args:
        flops_per_sample: Training FLOPs (forward and backward) per sample.
        samples_per_step: Samples per optimizer step, over all GPUs (the global batch).
        step_time_s: Measured seconds per step.
        n_gpus: GPUs sharing the step.
        peak_flops_per_gpu: Dense peak FLOP/s of one GPU at the training precision.

    Returns:
        `samples_per_s`, `achieved_flops_per_gpu`, `mfu` (a fraction) and
        `ideal_step_time_s` (the step at peak).

    Raises:
        ValueError: A non-positive input.
    """
    work = positive("flops_per_sample", flops_per_sample) * positive("samples_per_step", samples_per_step)
    time_s, gpus = positive("step_time_s", step_time_s), count("n_gpus", n_gpus)
    peak = positive("peak_flops_per_gpu", peak_flops_per_gpu)
    achieved = work / time_s / gpus
    return {"samples_per_s": samples_per_step / time_s, "achieved_flops_per_gpu": achieved,
            "mfu": achieved / peak, "ideal_step_time_s": work / (gpus * peak)}


def step_time(*, flops_per_sample: float, samples_per_step: float, n_gpus: int,
              peak_flops_per_gpu: float, mfu: float) -> dict[str, float]:
    """Step time predicted from an assumed MFU: the inverse of `mfu`.

    `step_time_s = flops_per_sample x samples_per_step / (n_gpus x peak x MFU)`.

    Args:
        flops_per_sample: Training FLOPs (forward and backward) per sample.
        samples_per_step: Samples per optimizer step, over all GPUs.
        n_gpus: GPUs sharing the step.
        peak_flops_per_gpu: Dense peak FLOP/s of one GPU at the training precision.
        mfu: Assumed model FLOPs utilisation, a fraction in (0, 1].

    Returns:
        `step_time_s`, `samples_per_s` and `achieved_flops_per_gpu`.

    Raises:
        ValueError: A non-positive input, or an MFU above 1.
    """
    work = positive("flops_per_sample", flops_per_sample) * positive("samples_per_step", samples_per_step)
    gpus, peak = count("n_gpus", n_gpus), positive("peak_flops_per_gpu", peak_flops_per_gpu)
    if positive("mfu", mfu) > 1:
        raise ValueError(f"mfu must be at most 1, got {mfu!r}")
    time_s = work / (gpus * peak * mfu)
    return {"step_time_s": time_s, "samples_per_s": samples_per_step / time_s,
            "achieved_flops_per_gpu": peak * mfu}
