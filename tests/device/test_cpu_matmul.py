"""train.cpu_matmul: bf16 matrix products on a CPU with AMX or (under autocast) AVX-512 BF16, fp32 by oneDNN on
AVX-512 without AMX, torch's BLAS elsewhere, recorded with the run."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from mlflow.tracking import MlflowClient

from pipeline.core.config import ParamsError
from pipeline.device import attention, cpu, cpu_matmul, distributed, peak
from pipeline.device.precision import of_choice
from tests.fixtures.cpu import AUTOCAST, BF16, EPYC, ONEDNN, SKYLAKE, XEON, ZEN, as_cpu
from tests.fixtures.train import final_weights, stage_args, write_corpus, write_params

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
CTX = distributed.Dist(0, 1, 0, CPU)
NATIVE_AVX512 = cpu.has_avx512() and not cpu.has_amx()


@pytest.mark.parametrize("setting, text, device, want", [
    ("auto", XEON, CPU, "bf16"), ("auto", EPYC, CPU, "fp32"), ("fp32", XEON, CPU, "fp32"),
    ("bf16", XEON, CPU, "bf16"), ("auto", XEON, CUDA, "fp32"), ("bf16", EPYC, CUDA, "fp32"),
    ("fp32", ZEN, CPU, "onednn"), ("auto", ZEN, CPU, "autocast"), ("bf16", ZEN, CPU, "autocast"),
    ("blas", ZEN, CPU, "fp32"), ("auto", SKYLAKE, CPU, "onednn"), ("fp32", SKYLAKE, CPU, "onednn"),
    ("blas", XEON, CPU, "fp32"), ("fp32", EPYC, CPU, "fp32"), ("fp32", ZEN, CUDA, "fp32"),
    ("autocast", ZEN, CPU, "autocast"), ("autocast", XEON, CPU, "fp32"), ("autocast", EPYC, CPU, "fp32"),
    ("autocast", SKYLAKE, CPU, "onednn"), ("autocast", ZEN, CUDA, "fp32")])
def test_bf16_on_amx_and_avx512_bf16_and_onednns_fp32_on_avx512_without_them(setting, text, device, want, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "onednn_keeps_fp32", lambda: True)
    assert cpu_matmul.choose(setting, device, text) == want


def test_fp32_stays_on_torchs_blas_where_onednn_would_round_to_bf16(monkeypatch, caplog):
    monkeypatch.setattr(cpu_matmul, "onednn_keeps_fp32", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert cpu_matmul.choose("fp32", CPU, ZEN) == "fp32"
    assert "oneDNN rounded a test product to bf16" in caplog.text


@pytest.mark.parametrize("text", [EPYC, SKYLAKE])
def test_asking_for_bf16_on_a_cpu_without_amx_or_avx512_bf16_fails_naming_the_key_and_the_remedy(text):
    with pytest.raises(ParamsError, match=r"train\.cpu_matmul = 'bf16'.*neither AMX nor AVX-512 BF16.*amx_bf16, "
                                          r"avx512_bf16.*'auto' or 'fp32'"):
        cpu_matmul.choose("bf16", CPU, text)
    with pytest.raises(ParamsError, match=r"train\.cpu_matmul = 'bf8': expected one of 'auto', 'fp32', 'blas', 'bf16'"):
        cpu_matmul.choose("bf8", CPU, XEON)


def test_asking_for_bf16_where_torch_lacks_onednn_says_so(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(ParamsError, match=r"train\.cpu_matmul = 'bf16'.* or torch lacks oneDNN, .*'auto' or 'fp32'"):
        cpu_matmul.choose("bf16", CPU, ZEN)  # AVX-512 BF16, but no oneDNN to use it


def test_the_choice_and_the_peak_see_avx512_bf16_only_with_the_avx512_torch_needs(monkeypatch):
    partial = ZEN.replace(" avx512bw", "")  # avx512_bf16 without all of AVX-512: neither oneDNN nor its peak
    monkeypatch.setattr(cpu_matmul, "onednn_keeps_fp32", lambda: True)
    assert cpu_matmul.choose("auto", CPU, partial) == "fp32"
    assert peak.nominal_cpu_peak(2, partial, products="bf16") is None
    assert cpu.has_avx512_bf16(ZEN) and peak.nominal_cpu_peak(2, ZEN, products="bf16") is not None


@pytest.mark.parametrize("caps, text, want_class, want_choice", [
    ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, ZEN,
     "AVX2 only", "fp32"),
    ({"ONEDNN_MAX_CPU_ISA": "avx2"}, XEON, "AVX2 only", "fp32"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, XEON.replace("avx512f", "avx512f avx512dq avx512bw avx512vl"),
     "AVX-512 BF16, no AMX", "autocast"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, ZEN, "AVX-512, no bf16", "onednn"),
    ({"ATEN_CPU_CAPABILITY": "default"}, ZEN, "no AVX2", "fp32"),
    ({"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": "avx512"}, XEON, "AMX", "bf16")])  # caps that narrow nothing
def test_an_isa_cap_makes_the_choice_and_the_peak_those_of_the_cpu_it_leaves(monkeypatch, caps, text, want_class,
                                                                              want_choice):
    """A process capped to AVX2 on an AVX-512 CPU chooses torch's BLAS and counts the AVX2 peak, as a CPU with AVX2
    only does, and its class names the cap; a cap at or above the CPU's units changes nothing."""
    monkeypatch.setattr(cpu_matmul, "onednn_keeps_fp32", lambda: True)
    for name in cpu.CAPS:
        monkeypatch.delenv(name, raising=False)
    uncapped = peak.nominal_cpu_peak(2, text)
    for name, value in caps.items():
        monkeypatch.setenv(name, value)
    narrowed = cpu.caps()
    assert cpu_matmul.choose("auto", CPU, text) == want_choice
    shown = " ".join(f"{k}={v}" for k, v in narrowed.items())
    assert cpu.cpu_class(text).endswith(f"({want_class}; ISA capped: {shown})" if narrowed else f"({want_class})")
    if want_class == "AVX2 only":
        assert cpu.unit(text) == "AVX2" and not cpu.has_avx512(text) and not cpu.has_amx(text)
        assert peak.nominal_cpu_peak(2, text) == pytest.approx(uncapped / 2)  # 32 fp32 FLOP a cycle, not 64
    if not narrowed:
        assert peak.nominal_cpu_peak(2, text) == uncapped and cpu.unit(text) == cpu.unit(text, {})


@pytest.mark.parametrize("choice, dtype", [("autocast", torch.bfloat16), ("onednn", torch.float32),
                                           ("bf16", torch.float32), ("fp32", torch.float32)])
def test_a_choice_steps_under_bf16_autocast_only_for_autocast(choice, dtype):
    a = torch.randn(4, 8)
    with of_choice(choice).autocast():
        assert (a @ a.T).dtype == dtype  # AMX's bf16 products keep fp32 tensors: torch rounds inside oneDNN
    assert (a @ a.T).dtype == torch.float32


def test_bf16_products_switch_the_torch_flag_and_the_cpu_attention_kernel_and_back(monkeypatch):
    cpu_matmul.use("bf16")
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert attention.choice(CPU) == ("math",) and "math kernel on a CPU" in attention.use(CPU)
    monkeypatch.setenv(attention.ENV, "math")  # the same backends on CUDA are described as CUDA's
    assert attention.describe(attention.choice(CUDA), CUDA).startswith("scaled_dot_product_attention backends math")
    monkeypatch.delenv(attention.ENV)
    cpu_matmul.use("fp32")
    assert torch.backends.mkldnn.matmul.fp32_precision == "none" and attention.choice(CPU) is None
    assert attention.use(CPU) == attention.CPU
    cpu_matmul.use("onednn")  # fp32 by oneDNN: the same flag, the same attention kernel
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16" and attention.choice(CPU) == ("math",)
    cpu_matmul.use("autocast")  # bf16 autocast: oneDNN's kernels, the math attention kernel
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16" and attention.choice(CPU) == ("math",)
    assert of_choice("autocast").dtype == torch.bfloat16 and of_choice("bf16").dtype == torch.float32
    with pytest.raises(ValueError, match="expected one of 'fp32', 'onednn', 'bf16', 'autocast', got 'auto'"):
        cpu_matmul.use("auto")


def test_bf16_products_keep_more_compiled_kernels_than_onednns_default_unless_set_outside(monkeypatch):
    name, capacity = cpu_matmul.PRIMITIVE_CACHE
    monkeypatch.setenv(name, "0")  # restored after the test
    monkeypatch.delenv(name)
    cpu_matmul.use("fp32")
    assert name not in os.environ
    cpu_matmul.use("bf16")
    assert os.environ[name] == capacity and int(capacity) > 1024
    monkeypatch.setenv(name, "2048")
    cpu_matmul.use("bf16")
    assert os.environ[name] == "2048"


def test_the_nominal_peak_of_bf16_products_is_the_amx_tiles_rate_and_the_paper_keeps_fp32(tmp_path, monkeypatch):
    assert peak.nominal_cpu_peak(2, XEON, products="bf16") == pytest.approx(2 * 2500e6 * 1024)
    assert peak.nominal_cpu_peak(2, EPYC, products="bf16") is None
    assert peak.nominal_cpu_peak(2, ZEN, products="bf16") == pytest.approx(2 * 3000e6 * 64 * 2)  # twice fp32's
    as_cpu(monkeypatch, XEON)
    monkeypatch.setattr(peak, "measured_peak", lambda *a: pytest.fail("measured despite a nominal figure"))
    threads = torch.get_num_threads()
    found = peak.peak_flops(CTX, of_choice("bf16"), tmp_path / "peak.json")
    assert (found.flops, found.source) == (pytest.approx(threads * 2500e6 * 1024), "nominal")
    assert found.fp32_tflops == pytest.approx(threads * 2500e6 * 64 / 1e12)  # the paper's estimate: fp32 (avx512f)
    fp32 = peak.peak_flops(CTX, of_choice("fp32"), tmp_path / "peak.json")
    assert fp32.flops == pytest.approx(threads * 2500e6 * 64)


def train_once(root, monkeypatch, text: str, setting: str) -> tuple[dict, dict, list[str]]:
    """The train stage on a CPU whose flags are `text`: (metrics/train.json, final weights, precisions used)."""
    as_cpu(monkeypatch, text)
    monkeypatch.setattr(cpu_matmul, "onednn_keeps_fp32", lambda: True)  # whatever the CPU under the test
    used, real_use = [], cpu_matmul.use
    monkeypatch.setattr(cpu_matmul, "use", lambda choice: (used.append(choice), real_use(choice))[1])
    write_corpus(root)
    from stages import train

    train.main(stage_args(root, write_params(root / "params.yaml", max_steps=3, cpu_matmul=setting)))
    return json.loads((root / "metrics" / "train.json").read_text()), final_weights(root), used


@pytest.mark.parametrize("text, setting, want", [(XEON, "auto", BF16), (EPYC, "auto", "fp32"), (ZEN, "fp32", ONEDNN),
                                                   (ZEN, "auto", AUTOCAST)])
def test_the_train_stage_records_the_precision_auto_chose_in_its_metrics_log_and_mlflow(
        tmp_path, monkeypatch, caplog, one_thread, text, setting, want):
    with caplog.at_level(logging.INFO):
        metrics, _, used = train_once(tmp_path, monkeypatch, text, setting)
    assert used == [{BF16: "bf16", "fp32": "fp32", ONEDNN: "onednn", AUTOCAST: "autocast"}[want]]
    assert metrics["precision"] == want and f"precision: {want}" in caplog.text
    # MFU against the AMX tiles' rate, the FMA units', or twice theirs for AVX-512's bf16 dot products
    per_cycle = {BF16: 1024, "fp32": 32, ONEDNN: 64, AUTOCAST: 128}[want]
    clock = {BF16: 2500e6, "fp32": 2445.406e6, ONEDNN: 3000e6, AUTOCAST: 3000e6}[want]
    assert (metrics["peak_flops"], metrics["peak_flops_source"]) == (pytest.approx(clock * per_cycle), "nominal")
    assert ("attention: torch's math kernel on a CPU with oneDNN's matrix products" in caplog.text) == (want != "fp32")
    client = MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.data.params.get("precision") for r in runs] == [want]


def test_bf16_products_train_the_same_weights_twice_on_one_machine(tmp_path, monkeypatch, one_thread):
    first = train_once(tmp_path / "a", monkeypatch, XEON, "bf16")[1]
    cpu_matmul.use("fp32")
    second = train_once(tmp_path / "b", monkeypatch, XEON, "bf16")[1]
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_bf16_autocast_trains_other_weights_than_fp32_and_the_same_twice(tmp_path, monkeypatch, one_thread):
    fp32 = train_once(tmp_path / "fp32", monkeypatch, ZEN, "fp32")[1]
    first = train_once(tmp_path / "a", monkeypatch, ZEN, "bf16")[1]
    second = train_once(tmp_path / "b", monkeypatch, ZEN, "bf16")[1]
    cpu_matmul.use("fp32")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert any(not torch.equal(first[k], fp32[k]) for k in first)  # the steps ran in bf16


@pytest.mark.skipif(not cpu.has_amx(), reason="needs a CPU with AMX (amx_bf16)")
def test_on_amx_bf16_products_round_the_inputs_to_bf16_and_sum_in_fp32():
    a = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    b = torch.randn(256, 96, generator=torch.Generator().manual_seed(1))
    exact, rounded = a.double() @ b.double(), a.bfloat16().double() @ b.bfloat16().double()
    assert (a @ b - exact).abs().max() < 1e-3  # fp32 products
    cpu_matmul.use("bf16")
    product = a @ b
    assert product.dtype == torch.float32
    assert (product - rounded).abs().max() < 1e-4  # the bf16-rounded inputs' product, summed in fp32
    assert (product - exact).abs().max() > 1e-2  # not the fp32 product


@pytest.mark.skipif(not NATIVE_AVX512, reason="needs a CPU with AVX-512 and without AMX")
def test_on_avx512_without_amx_onednns_products_keep_fp32():
    assert cpu_matmul.onednn_keeps_fp32() and cpu_matmul.choose("fp32", CPU) == "onednn"
    a = torch.randn(1250, 256, generator=torch.Generator().manual_seed(0))
    b = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    exact, rounded = a.double() @ b.double(), a.bfloat16().double() @ b.bfloat16().double()
    cpu_matmul.use("onednn")
    product = a @ b
    assert (product - exact).abs().max() < 1e-3 < (rounded - exact).abs().max()  # fp32's rounding, not bf16's


def test_the_matmul_bench_times_every_stored_batch_and_meets_each_shape_first_once(tmp_path):
    from bench.cpu import matmul as bench
    from pipeline.corpus.formats import load_batches
    tokenized, batches = write_corpus(tmp_path, n_train=60, max_len=9, max_tokens=30)
    vocab, distinct, epoch = bench.stream(5000, 1250, (tokenized, batches))
    stored = load_batches(batches, "train")
    assert vocab == json.loads((tokenized / "meta.json").read_text())["vocab_size"]  # the corpus's, not the default's
    assert len(epoch) == len(stored) and sum(len(b.src) for b in epoch) == 60  # every pair once
    shapes = [bench.shape(b) for b in epoch]
    assert [bench.shape(b) for b in distinct] == list(dict.fromkeys(shapes))  # each shape once, as an epoch meets it
    assert 1 < len(distinct) < len(epoch)
    again = bench.stream(5000, 1250, (tokenized, batches))[2]
    other = bench.stream(5000, 1250, (tokenized, batches), seed=1)[2]
    assert [b.src.tolist() for b in again] == [b.src.tolist() for b in epoch]  # a seeded order
    assert [b.src.tolist() for b in other] != [b.src.tolist() for b in epoch]


def test_the_matmul_benchs_autocast_way_computes_in_bf16_and_leaves_fp32_after_it():
    from bench.cpu import matmul as bench
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    with bench.way("fp32", autocast=True):
        assert (a @ b).dtype == torch.bfloat16
    with bench.way("fp32"):
        assert (a @ b).dtype == torch.float32
    assert (a @ b).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def test_the_matmul_benchs_autocast_way_computes_in_bf16_and_leaves_fp32_after_it():
    from bench.cpu import matmul as bench
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    with bench.way("autocast"):
        assert (a @ b).dtype == torch.bfloat16
    with bench.way("onednn"):
        assert (a @ b).dtype == torch.float32
    assert (a @ b).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
