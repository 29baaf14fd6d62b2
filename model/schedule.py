"""The learning-rate schedule of Sec. 5.3, as one pure function, and an optional linear cool-down.

The paper trains 100K steps on the inverse-square-root decay and averages the
last checkpoints. A run of a few thousand steps ends while that lr is still
high; a linear cool-down over its last steps (the "warmup-stable-decay" shape's
decay phase) brings it to zero at max_steps. cooldown_steps = 0 is the paper.
"""

from __future__ import annotations


def lrate(step: int, d_model: int, warmup_steps: int) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), Eq. 3; `step` counts from 1.

    Rises linearly for the first `warmup_steps` steps, peaks at step == warmup_steps,
    then decays with the inverse square root of the step number.
    """
    if step < 1:
        raise ValueError(f"lrate: step counts from 1, got {step}")
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def cooldown(step: int, max_steps: int, cooldown_steps: int) -> float:
    """The factor on lrate over the last `cooldown_steps` of `max_steps`: 1 before them, then linearly down to
    1 / cooldown_steps at step == max_steps (never 0: every step still learns); 1 throughout when cooldown_steps is 0.
    """
    if step < 1:
        raise ValueError(f"cooldown: step counts from 1, got {step}")
    if cooldown_steps <= 0:
        return 1.0
    return min(1.0, (max_steps - step + 1) / cooldown_steps)
