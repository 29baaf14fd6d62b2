"""The loader's work a step is the step's own: memory it touches does not grow with the training split."""

from __future__ import annotations

import tracemalloc

import numpy as np
import torch

from pipeline.corpus import steps
from pipeline.corpus.formats import Ragged
from pipeline.training.loader import TrainingData

CPU = torch.device("cpu")
BATCH_ROWS = 64


def split(pairs: int, shift: int) -> Ragged:
    """`pairs` sentences of 3 to 17 tokens (a pattern set by `shift`), ids 4 upwards."""
    lengths = 3 + (np.arange(pairs) * 7 + shift) % 15
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Ragged(4 + np.arange(offsets[-1], dtype=np.uint16) % 50, offsets)


def data(pairs: int) -> TrainingData:
    """A split of `pairs` pairs whose stored batches are its first 4 x BATCH_ROWS pairs (the same at any size)."""
    src, tgt = split(pairs, 0), split(pairs, 5)
    batches = Ragged(np.arange(4 * BATCH_ROWS, dtype=np.int64), np.arange(0, 5 * BATCH_ROWS, BATCH_ROWS))
    return TrainingData(60, src, tgt, src, tgt, batches, batches, 1.1)


def step_peak_bytes(d: TrainingData) -> tuple[int, list]:
    """Peak bytes allocated by one step's host data work as the trainer does it (steps 2 of 4, 2 pieces, budget 100),
    and the micro-batches' tensors."""
    order = steps.epoch_order(len(d.train_batches), 0, 0)
    mine, n_micro = steps.rank_share(order[:2], 0, 1, 1)
    d.micro_batches(mine, n_micro, int(order[0]), CPU, 1, 100)  # warm: caches, first touches
    tracemalloc.start()
    try:
        steps.next_step(order, 2, 0, 2, 0)
        micro = d.micro_batches(mine, n_micro, int(order[0]), CPU, 1, 100)
        d.lengths(order[:2])
        return tracemalloc.get_traced_memory()[1], micro
    finally:
        tracemalloc.stop()


def test_a_steps_data_work_touches_memory_of_the_step_not_of_the_split():
    """100x the pairs, the same step: the same micro-batches, built with no array of the split's size (a pass over
    the split's offsets, e.g. np.diff of them, allocates 8 bytes a pair: 1.6 MB here)."""
    small_peak, small = step_peak_bytes(data(2_000))
    large_peak, large = step_peak_bytes(data(200_000))
    assert len(small) == len(large) > 2  # both pieces cut within the budget
    for (a, real_a), (b, real_b) in zip(small, large):
        assert real_a == real_b and a.tokens == b.tokens
        for x, y in ((a.src, b.src), (a.tgt_in, b.tgt_in), (a.labels, b.labels)):
            assert torch.equal(x, y)
    assert large_peak < small_peak + 100_000, (small_peak, large_peak)
