"""Sequence-length curriculum: crop short early, long late.

Attention memory grows with the square of the crop length (and triangle attention
with its cube), so starting short keeps early steps cheap and stable, and the
longest, most expensive steps come once the model has learned local structure.
AlphaFold 2 trains with 256-residue crops and fine-tunes at 384; BERT used 128
tokens for 90% of steps, then 512.
"""

from __future__ import annotations


# --8<-- [start:length_curriculum]
def curriculum_length(
    step: int, *, start: int, end: int, ramp_steps: int, multiple: int = 8
) -> int:
    """Crop length at a step: linear ramp from ``start`` to ``end``, then constant.

    The value is rounded down to a multiple of ``multiple`` (tensor-core friendly
    shapes, fewer distinct shapes for the allocator and compilers) but never below
    ``start``.

    Args:
        step: Optimizer step, from 0.
        start: Crop length at step 0.
        end: Crop length from ``ramp_steps`` on.
        ramp_steps: Steps to go from ``start`` to ``end``; 0 means ``end`` at once.
        multiple: Granularity of the returned length.

    Returns:
        The maximum sequence length to crop to at this step.

    Raises:
        ValueError: Unless ``0 < start <= end``.
    """
    if not 0 < start <= end:
        raise ValueError(f"need 0 < start <= end, got {start}, {end}")
    progress = 1.0 if ramp_steps <= 0 else min(max(step, 0) / ramp_steps, 1.0)
    length = start + progress * (end - start)
    return max(start, int(length) // multiple * multiple)
# --8<-- [end:length_curriculum]
