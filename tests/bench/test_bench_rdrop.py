"""bench.cpu.rdrop: the step's time plain and with R-Drop on each share of rows asked for, under the products and
autocast that train.cpu_matmul picks on this CPU."""

import re

import torch

from bench.cpu import rdrop
from pipeline.device.precision import resolve


def test_bench_rdrop_times_each_fraction_asked_for_under_the_chosen_products(capsys):
    rdrop.main(["--steps", "1", "--rounds", "1", "--threads", "1", "--fractions", "0.5", "1.0", "--cpu-matmul", "auto"])
    out = capsys.readouterr().out
    header, *ways = out.strip().splitlines()
    assert resolve("auto", torch.device("cpu")).label in header
    assert [line.split(":")[0] for line in ways] == ["plain", "fraction 0.5", "fraction 1.0"]
    ratios = [float(re.search(r"step time ([0-9.]+)x", line).group(1)) for line in ways]
    passes = [float(re.search(r"passes ([0-9.]+)x", line).group(1)) for line in ways]
    assert ratios[0] == 1.0 and all(ratio > 0 for ratio in ratios) and passes == [1.0, 1.5, 2.0]
