"""bench/harness/allreduce.py: DDP's buckets as it all-reduces them, and the 8-GPU step's communication modelled."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from bench.harness import allreduce


def test_the_buckets_are_ddps_own_after_its_rebuild_in_the_order_the_gradients_come():
    """A group of one: the first step one bucket of everything (DDP's initial layout), then, rebuilt in the order
    the gradients became ready, the last layer's first and the embedding's last, cut at the 20 KiB cap."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64),
                              nn.Linear(64, 1000))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
        buckets, x = allreduce.Buckets(ddp), torch.randint(0, 1000, (8,))
        ddp(x).sum().backward()
        assert buckets.layout == [sum(p.numel() * 4 for p in model.parameters())]
        for _ in range(2):
            ddp(x).sum().backward()
            assert buckets.layout == [(64 * 1000 + 1000) * 4, 2 * (64 * 64 + 64) * 4, 1000 * 64 * 4]
        model.zero_grad()
        ddp(x).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]  # the hook all-reduced as DDP's own: over one, as they were
        model.zero_grad()
        model(x).sum().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), got))
    finally:
        dist.destroy_process_group()


def test_the_step_is_the_slowest_ranks_compute_the_exposed_all_reduce_and_the_flags():
    gb = 1e9
    # 8 GPUs at 100 GB/s: a ring moves 2 x 7/8 of each bucket: 1 GB -> 17.5 ms
    p = allreduce.predict(0.030, [gb, gb, gb], 8, busbw_gbs=100, flag_ms=0.5, slowest=1.2)
    assert p["compute"] == pytest.approx(0.036) and p["allreduce"] == pytest.approx(3 * 0.0175)
    assert p["overflow"] == pytest.approx(2 * 0.0175 - 2 / 3 * 0.036)  # two buckets overlap 24 ms of backward
    assert p["hidden"] == pytest.approx(2 / 3 * 0.036) and p["tail"] == pytest.approx(0.0175)
    assert p["step"] == pytest.approx(0.036 + p["overflow"] + 0.0175 + 0.0005)
    fast = allreduce.predict(0.030, [gb, gb, gb], 8, busbw_gbs=1000, flag_ms=0.0)
    assert fast["overflow"] == 0.0 and fast["step"] == pytest.approx(0.030 + 0.00175)  # only the last is exposed
