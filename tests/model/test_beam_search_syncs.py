"""Beam search reads the device at most once a decoding step (model/beam_search.py): on a GPU each read waits for
every kernel queued before it, so a step with six reads runs at the speed of six round trips.

A CPU shows no waiting, but the operations that wait on a GPU are the same: a dispatch mode records them (a scalar
read, a boolean mask or nonzero, whose output size is on the device, a tensor made from Python data), and
Tensor.tolist is watched too (on a CPU tensor it reads memory without dispatching).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.beam_search import beam_search
from tests.fixtures.beam import BOS, EOS, EosBias, sources, tiny_model

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal}
FROM_HOST = {aten.lift_fresh, aten.lift_fresh_copy}  # torch.tensor(python data) on a device: a copy that waits


def waits(func, args) -> str | None:
    """Why `func(*args)` would wait for a GPU (a read, or a tensor from host data), or None."""
    packet = func.overloadpacket
    if packet in READS or packet in FROM_HOST:
        return packet.__name__
    if packet in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
        return f"{packet.__name__} with a boolean mask"
    return None


class Reads(TorchDispatchMode):
    """Records, in order, each decoding step (a decode_step call) and each operation that waits for the device."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if why := waits(func, args):
            self.events.append(why)
        return func(*args, **(kwargs or {}))

    def per_step(self) -> list[list[str]]:
        """The reads before the first step, then those from each step's start to the next one's (the last: to the
        search's end)."""
        segments = [[]]
        for event in self.events:
            if event == "step":
                segments.append([])
            else:
                segments[-1].append(event)
        return segments


@pytest.mark.parametrize("bias", [0.0, 2.0, -1e4])  # as trained; EOS likelier (sentences finish, beams drop); never
def test_a_decoding_step_reads_the_device_at_most_once(monkeypatch, bias):
    model = EosBias(tiny_model(seed=3), bias).eval()
    src = sources([5, 3, 8, 6, 4, 7], seed=3)
    reads = Reads()
    step = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda *a: reads.events.append("step") or step(*a))
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.events.append("tolist") or tolist(self))
    with reads:
        hyps = beam_search(model, src, 4, 0.6, 1.0, 6, BOS, EOS)
    monkeypatch.undo()
    assert hyps == beam_search(model, src, 4, 0.6, 1.0, 6, BOS, EOS)  # watching changed nothing
    first, *steps, last = reads.per_step()
    assert len(steps) >= 3, reads.events  # the search ran several steps
    assert len(first) <= 1, first  # before the first step: the output length limits, once a search
    for t, step_reads in enumerate(steps, start=1):
        assert len(step_reads) <= 1, f"step {t}: {step_reads}"
    assert len(last) <= 1 + 4, last  # the last step's read, then the results once
