"""The learning-rate schedule of Sec. 5.3, as one pure function."""

from __future__ import annotations


def lrate(step: int, d_model: int, warmup_steps: int) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), Eq. 3; `step` counts from 1.

    Rises linearly for the first `warmup_steps` steps, peaks at step == warmup_steps,
    then decays with the inverse square root of the step number.
    """
    if step < 1:
        raise ValueError(f"lrate: step counts from 1, got {step}")
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)
