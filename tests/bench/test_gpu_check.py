"""bench.gpu.check (make gpu-check) on a CPU: it times the train stage's own Trainer, so a break shows without a GPU.

What a GPU adds (NCCL instead of gloo, autocast bf16, inductor, memory) cannot run here; everything else does:
the presets' settings, each mode's fresh corpus through the batch stage, the process group of one and DDP, the
prefetch thread, train.compile, train.cuda_graphs (compiled as train.compile: no CUDA graphs off CUDA) and the
compiled reference step (dynamo with TRANSFORMER_COMPILE_BACKEND=eager or aot_eager, as tests/device/test_compile.py), the
checkpoint it saves, decoding in the translate stage's precision and every printed line.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from bench.gpu import check as gpu_check
from bench.harness import decoding as gpu_decode
from bench.harness import kernels as gpu_kernels
from bench.harness import gpu as gpu_setup
from bench.harness import steps as gpu_timing
from model.dropout import Dropout
from model.transformer import Transformer
from pipeline.core import config
from pipeline.core.tracking import StageRun
from pipeline.corpus import steps
from pipeline.device import compiled, distributed, precision
from pipeline.device.precision import resolve
from pipeline.training.trainer import Trainer
from pipeline.weights import fingerprint
from pipeline.weights.checkpoint import resume_point
from tests.fixtures.train import ROOT

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_uses_the_presets_batch_config_and_times_at_least_50_steps():
    for name in gpu_check.PRESETS:
        preset = config.compose([f"experiment=wmt14_en_de_{name}", "train.devices=1"])
        s = gpu_check.preset(name, CPU, tiny=False)
        assert s.batch_cfg == config.parse(preset, "batch", config.BatchConfig)
        assert s.vocab == preset["tokenize"]["vocab_size"] == 37000
    assert "vocabulary 37000" in " ".join(gpu_check.__doc__.split())
    said = re.search(r"--steps (\d+)", gpu_check.__doc__)
    assert said and int(said[1]) == gpu_check.arguments().parse_args([]).steps >= 50


def test_each_stream_is_a_fresh_corpus_batched_by_the_batch_stage_with_the_whole_config(tmp_path, monkeypatch):
    s = gpu_check.preset("base", CPU, tiny=True)
    calls = []
    write_batches = gpu_setup.write_batches
    monkeypatch.setattr(gpu_setup, "write_batches", lambda *a: calls.append(a) or write_batches(*a))
    a = gpu_setup.training_data(s, 1, 2, tmp_path / "a")
    b = gpu_setup.training_data(s, 2, 2, tmp_path / "b")
    assert all(call[3] is s.batch_cfg for call in calls)  # the BatchConfig as composed, whatever fields it has
    # Enough batches that the warm-up, the timed steps and the prefetched step come from one epoch.
    assert min(len(a.train_batches), len(b.train_batches)) >= (gpu_setup.WARMUP_STEPS + 3) * s.batches_per_step
    assert gpu_setup.digest(a) != gpu_setup.digest(b)


def test_gpu_check_times_the_trainers_step_as_one_gpu_runs_it_in_epoch_order_and_saves_a_resumable_checkpoint(
        tmp_path):
    """A train.devices=1 run has no DDP, and neither has the line that times it (the share line has: its own test);
    the warm-up ends on a step that compiled nothing, the profiled step comes after the timed ones."""
    s = gpu_check.preset("base", CPU, tiny=True)
    data = gpu_setup.training_data(s, 1, 2, tmp_path / "corpus")
    n = 2
    with gpu_setup.process_group(CPU) as ctx:
        r = gpu_timing.time_training(s, data, ctx, n, "eager", tmp_path / "ck")
        t = r.pop("trainer")
        assert not isinstance(t.loss_model, DistributedDataParallel)
        t.close()
    assert r["tokens_per_s"] > 0 and r["accum"] == 2 and not r["compiled"]  # tokens_per_step 1024 / max_tokens 512
    assert r["warmup_seconds"] > 0 and r["new_graphs"] == 0
    assert r["warmup_steps"] == gpu_setup.WARMUP_STEPS and r["warmup_settled"]  # eager: nothing to compile
    # The steps took the batches in the trainer's epoch order, none twice, all in the first epoch.
    taken = [b for ids in r["batches"] for b in ids]
    assert taken == steps.epoch_order(len(data.train_batches), s.train_cfg.seed, 0)[: len(taken)].tolist()
    assert len(r["batches"]) == gpu_setup.WARMUP_STEPS + n + 1 and r["epochs"] == 1  # + the profiled step
    assert len(r["batch_shapes"]) == n * r["accum"]
    # The checkpoint it timed is the train stage's: resumed as one (sealed, the trainer's code) ...
    found = resume_point(tmp_path / "ck", "gpu-check", fingerprint.code_fingerprint("stages.train"))
    assert found is not None and found.payload["step"] == gpu_setup.WARMUP_STEPS + n + 1
    # ... with the weights the Trainer gets without the group: DDP over one process changes no number.
    plain = Trainer(data, s.model_cfg, s.train_cfg.__class__(**{**vars(s.train_cfg), "compile": False}), s.max_tokens,
                    distributed.Dist(0, 1, 0, CPU), StageRun(), phash="", precision=resolve(s.train_cfg.cpu_matmul, CPU))
    assert not isinstance(plain.loss_model, DistributedDataParallel)
    for _ in range(gpu_setup.WARMUP_STEPS + n + 1):
        plain.step(plain.epoch_order())
    for name, want in plain.model.state_dict().items():
        assert torch.equal(found.payload["model"][name], want), name


def test_decoding_casts_the_model_as_the_translate_stage_does_and_times_the_training_precision_beside(monkeypatch):
    """The stage's decoding_precision (translate.precision auto): fp32, also where training runs bf16 (pretended
    here); the second line casts to the training precision, bf16 there."""
    s = gpu_check.preset("base", CPU, tiny=True)
    src, _ = gpu_check.synthetic_corpus(4, seed=5, vocab=s.vocab, mean=8, sd=2, longest=12)
    sources = [np.asarray(src[i], dtype=np.int64) for i in range(len(src))]
    model, dtype = gpu_decode.decoding_model(s, stage_precision=True)
    assert dtype == torch.float32 and {p.dtype for p in model.parameters()} == {torch.float32}
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: torch.bfloat16)
    model, dtype = gpu_decode.decoding_model(s, stage_precision=True)
    assert dtype == torch.float32 and {p.dtype for p in model.parameters()} == {torch.float32}
    model, dtype = gpu_decode.decoding_model(s, stage_precision=False)
    assert dtype == torch.bfloat16 and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    rate, name = gpu_decode.time_decoding(s, sources, stage_precision=False)
    assert rate > 0 and name == "bf16"
    assert gpu_decode.time_decoding(s, sources, stage_precision=True)[1] == "fp32"


@pytest.mark.parametrize("name, kind", [
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
     "false>(pytorch_flash::Flash_fwd_params)", "flash"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(pytorch_flash::Flash_bwd_params)", "flash"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 128, 64, true, true>::Params)", "efficient"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)",
     "efficient"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float, c10::BFloat16, "
     "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(c10::BFloat16*, c10::BFloat16 const*, int)", None),
    ("triton_per_fused__safe_softmax_add_masked_fill_0", None),  # a softmax kernel may be the loss's fused chunk
    ("aten::_scaled_dot_product_attention_math", "math"),  # the math backend: its aten op (profiled's CPU events)
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "cudnn"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", None),
    ("triton_red_fused__log_softmax_mul_neg_sum_3", None),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", None),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >", None),
])
def test_cuda_kernel_names_are_told_apart_by_attention_backend(name, kind):
    assert gpu_kernels.attention_kernel(name) == kind


def test_training_on_the_math_kernel_fails_on_a_gpu_only():
    ran = {"attention": {"efficient": 96, "math": 12}}
    [failure] = gpu_check.failures_of("base", "eager", ran, torch.device("cuda", 0))
    assert "math attention kernel" in failure and "base eager" in failure
    assert gpu_check.failures_of("base", "eager", {"attention": {"efficient": 96, "flash": 48}},
                                 torch.device("cuda", 0)) == []
    assert gpu_check.failures_of("base", "eager", {"attention": None}, CPU) == []
    assert gpu_kernels.attention_kernels([("fmha_cutlassF_x", 3), ("flash_fwd_kernel", 2), ("gemm", 9),
                                          ("fmha_cutlassB_y", 3)]) == {"flash": 2, "efficient": 6}


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) is None
    assert capsys.readouterr().out.splitlines() == [
        "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check"]


def tokens_per_s(line: str) -> float:
    return float(line.split(" target tokens/s")[0].split(": ")[1].replace(",", ""))


@pytest.mark.slow
def test_gpu_check_prints_the_reference_then_each_mode_on_its_own_corpus_then_decoding(monkeypatch, capsys, tmp_path):
    """--tiny (hidden): the same code with a small model on the CPU, so the GPU run meets no untried line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(compiled.BACKEND_ENV, "eager")  # dynamo without AOT autograd: the fastest compile there is
    # Dropout as on a GPU (torch's, which dynamo traces; a CPU's mask of random words breaks the graph), so the
    # step modes' graphs are those a GPU builds
    monkeypatch.setattr(Dropout, "forward", lambda self, x: torch.nn.functional.dropout(x, self.p, self.training))
    torch._dynamo.reset()
    results = gpu_check.main(["--tiny", "--models", "base", "--steps", "2", "--compiled-steps", "3", "--sentences", "4",
                              "--summary", str(tmp_path / "summary.json")])
    torch._dynamo.reset()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "base reference", "base reference inside", "base eager", "base eager inside", "base", "base compiled",
        "base compiled inside", "base graphs", "base graphs inside", "base step", "base step inside",
        "base step-graphs", "base step-graphs inside", "base share", "base share communication (modelled)",
        "base share step", "base share step communication (modelled)", "base", "base"], lines
    (reference, _, eager, eager_inside, save, comp, comp_inside, graphs, graphs_inside, step, step_inside,
     step_graphs, step_graphs_inside, share, share_comm, share_step, _, decode_stage, decode_fp32) = lines
    r = results["base"]
    # The reference: the step's tokens in one fixed-shape micro-batch, the whole loss compiled.
    assert "1 x [32, 32] micro-batch" in reference and "under one torch.compile" in reference, reference
    assert r["reference"]["compiled"] and r["reference"]["warmup_graphs"] > 0
    assert r["reference"]["tokens_per_step"] == 1024
    every = ((eager, "eager"), (comp, "compiled"), (graphs, "graphs"), (step, "step"), (step_graphs, "step-graphs"))
    for line, mode in every:
        assert "target tokens/s" in line and "MFU" in line and "n/a peak" in line, line
        ratio = float(re.search(r", ([\d.]+)x of the reference \(", line)[1])
        assert ratio == pytest.approx(tokens_per_s(line) / tokens_per_s(reference), rel=0.02, abs=0.01), line
        n = 2 if mode == "eager" else 3  # the compiled modes: --compiled-steps at least
        assert f"{n} timed steps of a fresh corpus" in line and "in 2 batch(es) of batch.max_tokens 512" in line, line
        assert len(r[mode]["batches"]) == r[mode]["warmup_steps"] + n + 1  # + the profiled step, after the timing
    # Compile time apart from the timed steps' tokens/s, with the graphs compiled in each part.
    for line, mode in every[1:]:
        warm = re.search(r"\(compile: (\d+) warm-up steps [\d.]+ s \(the last compiled nothing new\), [1-9]\d* "
                         r"graph\(s\); 0 graph\(s\) compiled during the timed steps;", line)
        assert warm and int(warm[1]) == r[mode]["warmup_steps"] >= gpu_setup.WARMUP_STEPS, line
        assert r[mode]["compiled"] and r[mode]["warmup_graphs"] > 0 and r[mode]["new_graphs"] == 0
    assert re.search(r"\(3 warm-up steps [\d.]+ s \(the last compiled nothing new\); 2 timed", eager), eager
    assert "graph" not in eager, eager
    # What ran inside: kernel names and the sync check are CUDA's; dynamo's work during the timed steps is counted.
    assert eager_inside == ("base eager inside: attention kernels: kernel names are CUDA-only; host syncs not checked "
                            "(CUDA only)"), eager_inside
    assert "timed steps' dynamo: 0 graph(s), 0 graph break(s), 0 recompile(s)" in comp_inside, comp_inside
    for inside in (graphs_inside, step_graphs_inside):
        assert "CUDA graphs: n/a (not CUDA)" in inside and "0 recompile(s)" in inside, inside
    assert "timed steps' dynamo: 0 graph(s), 0 graph break(s), 0 recompile(s)" in step_inside, step_inside
    assert r["graphs"]["cuda_graphs"] is None and r["eager"]["attention"] is None
    # The step modes: the whole step one graph, no layer compiled on its own.
    for mode in ("step", "step-graphs"):
        assert r[mode]["compiled"] and r[mode]["warmup_graphs"] == 1, (mode, r[mode]["warmup_graphs"])
    # Each mode trained on a corpus of its own: other token ids, other batch shapes.
    modes = gpu_timing.MODES
    assert len({r[mode]["seed"] for mode in modes}) == len({r[mode]["corpus"] for mode in modes}) == len(modes) == 5
    assert set(r["eager"]["batch_shapes"]) != set(r["compiled"]["batch_shapes"])
    assert re.search(r"checkpoint [\d.]+ MiB saved in [\d.]+ s", save), save
    # One of 8 ranks' share of the eager step: each of the step's 2 batches cut into 4 row parts, rank 0's one
    # piece of the 8 (pipeline/corpus/steps.py), its own tokens counted; the prediction follows from its rate.
    assert re.fullmatch(r"base share: 1 of 8 GPUs \(DDP over a group of one\): [\d,]+ target tokens/s, [\d.]+% MFU, "
                        r"n/a peak, [\d.]+x the whole step's tokens/s per GPU; [\d,]+ target tokens/step on this GPU "
                        r"\(each batch cut into 4 row parts, rank 0's\), [\d.]+ ms a step; train.max_steps [\d,]+ on 8 "
                        r"GPUs: [\d.]+ h predicted \(compute only\)", share), share
    whole, part = r["eager"], r["share"]
    assert part["parts"] == 4 and part["ranks"] == 8 and whole["parts"] == 1
    assert all(len(ids) == 2 for ids in part["batches"])  # the step's batches, of which it trains its share
    assert 0 < part["tokens_per_step"] < whole["tokens_per_step"] / 4  # a 1/8 share: about an eighth of the tokens
    assert re.fullmatch(r"base share step: 1 of 8 GPUs \(DDP over a group of one\): [\d,]+ target tokens/s, .* "
                        r"[\d.]+ h predicted \(compute only\)", share_step), share_step
    assert r["share step"]["compiled"] and r["share step"]["parts"] == 4
    assert r["share step"]["seed"] != r["share"]["seed"]
    seconds = part["tokens_per_step"] / part["tokens_per_s"]
    hours = float(re.search(r"on 8 GPUs: ([\d.]+) h", share)[1])
    assert hours == pytest.approx(gpu_check.preset("base", CPU, tiny=True).train_cfg.max_steps * seconds / 3600,
                                  rel=0.02, abs=0.006)
    # Communication, modelled beside the compute: DDP's buckets as it all-reduced them (every parameter's bytes once),
    # each part in ms, and the step their sum.
    layout = part["buckets"]
    tiny = gpu_check.preset("base", CPU, True)
    model_bytes = sum(p.numel() * 4 for p in Transformer(tiny.model_cfg, tiny.vocab).parameters())
    assert len(layout) >= 1 and sum(layout) == model_bytes and part["slowest"] >= 1.0
    ms = dict((k, float(v)) for v, k in re.findall(r"([\d.]+) ms (a step|under backward|overflow|last bucket)", share_comm))
    compute = float(re.search(r"compute ([\d.]+) ms", share_comm)[1])
    flags = float(re.search(r"flag broadcast ([\d.]+) ms", share_comm)[1])
    total = float(re.search(r"; a step ([\d.]+) ms", share_comm)[1])
    assert total == pytest.approx(compute + ms["overflow"] + ms["last bucket"] + flags, abs=0.2), share_comm
    assert compute == pytest.approx(seconds * 1e3 * part["slowest"], rel=0.01, abs=0.05), share_comm
    assert f"{len(layout)} DDP buckets" in share_comm and "450 GB/s bus bandwidth" in share_comm, share_comm
    # --summary: the same figures as numbers, the share line's hours with communication too.
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["device"] == "cpu" and set(written["base"]) == set(results["base"])
    assert written["base"]["eager"]["tokens_per_s"] == pytest.approx(whole["tokens_per_s"])
    assert written["base"]["share"]["step_ms"]["step"] == pytest.approx(total, abs=0.1)
    assert written["base"]["share"]["hours_with_communication"] > written["base"]["share"]["hours_compute_only"]
    # Decoding: beam 4 as the translate stage decodes (fp32) and in the training precision (fp32 on a CPU).
    assert re.fullmatch(r"base: beam 4, the translate stage's precision, fp32 weights: [\d.]+ sentences/s "
                        r"\(translate_ids\)", decode_stage), decode_stage
    assert re.fullmatch(r"base: beam 4, the training precision, fp32 weights: [\d.]+ sentences/s \(translate_ids\)",
                        decode_fp32), decode_fp32


def test_make_gpu_day_runs_gpu_check_with_flags_it_has_within_nine_minutes():
    """The next lent GPU's one call: base before big, eager and the whole compiled step, within 540 s."""
    recipe = re.search(r"^gpu-day:\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)[1]
    command = " ".join(line.strip().rstrip("\\") for line in recipe.splitlines())
    assert "timeout 540 python -m bench.gpu.check" in command, command
    argv = command.split("bench.gpu.check", 1)[1].split("|")[0].split()
    args = gpu_check.arguments().parse_args(argv)
    assert args.models == ["base", "big"] and args.modes == ["eager", "step"] and args.summary is not None


def test_a_host_sync_in_the_timed_steps_fails_the_line_and_keeps_its_figures():
    synced = {"attention": {"efficient": 96}, "host_syncs": ["called a synchronizing CUDA operation"],
              "syncs_checked": True, "dynamo": None}
    [failure] = gpu_check.failures_of("base", "eager", synced, torch.device("cuda", 0))
    assert "1 host sync(s) in the timed steps: called a synchronizing CUDA operation" in failure
    assert "1 host sync(s) in the timed steps" in gpu_check.inside_line("base", "eager", synced)
    assert gpu_check.failures_of("base", "eager", synced | {"host_syncs": []}, torch.device("cuda", 0)) == []
