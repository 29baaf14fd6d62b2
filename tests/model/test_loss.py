"""model/loss.py: the chunked label-smoothed loss equals F.cross_entropy, in fp32 and in autocast's precision, and
never holds the whole [N, V] logits in fp32; torch's F.linear_cross_entropy path and the path without it both run."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from model import loss as loss_lib
from model import torch_loss
from model.config import ModelConfig
from model.transformer import Transformer
from tests.fixtures.train import MODEL, VOCAB, write_corpus

N, D, V, CHUNK, EPS = 50, 8, 40, 16, 0.1  # N not a multiple of CHUNK: four chunks, the last one of 2 rows
CPU = torch.device("cpu")
HAS_TORCH_LOSS = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


@pytest.fixture(autouse=True)
def _small_chunks_and_a_fresh_probe(monkeypatch):
    monkeypatch.setattr(loss_lib.ProjectedSmoothedLoss, "CHUNK", CHUNK)  # chunk_rows(CPU) reads it
    torch_loss._chunks_it.cache_clear()
    yield
    torch_loss._chunks_it.cache_clear()


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * D**-0.5 * 4  # logits of a few units, as a trained model's
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def loss_and_grads(fn, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w)
    (3 * loss).backward()  # a scale, as a loss divided by the step's tokens (or a grad scaler's) has
    return loss.detach(), h.grad, w.grad


def reference(hidden, weight, targets, eps=EPS):
    return loss_and_grads(lambda h, w: F.cross_entropy(h @ w.t(), targets, label_smoothing=eps, reduction="sum"),
                          hidden, weight)


class Ops(TorchDispatchMode):
    """Every aten op run inside: (name, [(dtype, shape) of its tensor inputs], [(dtype, shape) of the tensors it made:
    views and in-place results left out])."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = lambda tree: [(t.dtype, tuple(t.shape)) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
        # What the op made: not a view (W^T) or an in-place result, whose schema says it aliases an input.
        made = [] if any(r.alias_info is not None for r in func._schema.returns) else out
        self.ops.append((func.overloadpacket.__name__, seen((args, kwargs)), seen(made)))
        return out

    def largest(self, dtype: torch.dtype) -> int:
        """Elements of the largest `dtype` tensor any op made."""
        return max((torch.Size(shape).numel() for _, _, outs in self.ops for d, shape in outs if d == dtype), default=0)

    def rows_of(self, dtype: torch.dtype, columns: int) -> int:
        """Rows of the largest `dtype` tensor of `columns` columns ([..., columns]) any op made."""
        return max((torch.Size(shape[:-1]).numel() for _, _, outs in self.ops for d, shape in outs
                    if d == dtype and shape and shape[-1] == columns), default=0)

    def products(self) -> list[list[torch.dtype]]:
        return [[d for d, _ in ins] for name, ins, _ in self.ops if name in ("mm", "addmm", "bmm", "matmul", "linear")]


# --- (a) fp32: equal to F.cross_entropy ------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [0.0, EPS])
def test_the_chunked_loss_and_its_gradients_equal_cross_entropy_in_fp32(eps):
    hidden, weight, targets = inputs()
    want = reference(hidden, weight, targets, eps)
    by_function = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, eps, None, CHUNK),
                                 hidden, weight)
    with Ops() as ops:
        by_loss = loss_and_grads(lambda h, w: loss_lib.projected_smoothed_loss(h, w, targets, eps), hidden, weight)
    assert torch_loss.loss_path(CPU, None, eps) == "ours"
    for got in (by_function, by_loss):
        assert got[0].dtype == torch.float32
        for g, w, what in zip(got, want, ("loss", "grad hidden", "grad weight")):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=what)
    assert ops.largest(torch.float32) == CHUNK * V < N * V  # one chunk's logits at a time
    assert all(dtypes == [torch.float32] * len(dtypes) for dtypes in ops.products())


def test_without_gradients_it_computes_the_loss_alone():
    hidden, weight, targets = inputs()
    with torch.no_grad(), Ops() as ops:
        loss = loss_lib.projected_smoothed_loss(hidden, weight, targets, EPS)
    torch.testing.assert_close(loss, reference(hidden, weight, targets)[0], rtol=1e-5, atol=1e-5)
    assert len(ops.products()) == -(-N // CHUNK)  # h @ W^T per chunk; no g @ W, g^T @ h


# --- (b) under autocast: the products in bf16 / fp16, the sums in fp32, no fp32 [N, V] ------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_products_run_in_its_precision_and_no_fp32_logits_are_whole(dtype):
    hidden, weight, targets = inputs()
    want = reference(hidden, weight, targets)
    with torch.autocast("cpu", dtype=dtype), Ops() as ops:
        got = loss_and_grads(lambda h, w: loss_lib.projected_smoothed_loss(h, w, targets, EPS), hidden, weight)
    products = ops.products()
    assert len(products) == 3 * -(-N // CHUNK)  # h @ W^T, g @ W and g^T @ h per chunk
    assert all(dtypes == [dtype, dtype] for dtypes in products), products
    assert ops.largest(torch.float32) == CHUNK * V < N * V  # one chunk's fp32 logits, never all N rows'
    sums = [ins[0][0] for name, ins, _ in ops.ops if name in ("sum", "mean", "exp", "log", "logsumexp")]
    assert sums and set(sums) <= {torch.float32, torch.float64}  # log-sum-exp, softmax and the loss sum in fp32
    loss, grad_hidden, grad_weight = got
    assert loss.dtype == grad_hidden.dtype == grad_weight.dtype == torch.float32
    torch.testing.assert_close(loss, want[0], rtol=1e-2, atol=0.0)  # bf16 logits: 8 bits
    for g, w in zip((grad_hidden, grad_weight), want[1:]):
        torch.testing.assert_close(g, w, rtol=0.05, atol=0.05 * float(w.abs().max()))
    # Not fp32 in disguise: bf16 products differ from fp32 ones.
    assert not torch.allclose(grad_weight, want[2], rtol=1e-5, atol=1e-6)


def test_the_check_above_catches_whole_fp32_logits():
    """The same record of F.cross_entropy of the whole logits under autocast: an fp32 [N, V] is there."""
    hidden, weight, targets = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16), Ops() as ops:
        loss_and_grads(lambda h, w: F.cross_entropy(h @ w.t(), targets, label_smoothing=EPS, reduction="sum"),
                       hidden, weight)
    assert ops.largest(torch.float32) >= N * V


def test_the_fp16_gradient_keeps_its_small_entries_and_does_not_overflow():
    """fp16's smallest normal is 6e-5: unscaled, a logit gradient's eps / V entries (here 2.5e-5) lose bits."""
    hidden, weight, targets = inputs(1)
    g = torch.softmax(hidden @ weight.t(), dim=-1) - EPS / V
    scale = loss_lib._fp16_scale(g, hidden.half(), weight.half())
    assert scale.dtype == torch.float32 and float(scale) == 2.0 ** round(float(torch.log2(scale)))
    assert float(scale) > 1 and float((g * scale).abs().max()) < 2**15
    assert torch.isfinite((g * scale).half().t() @ hidden.half()).all()
    assert torch.isfinite((g * scale).half() @ weight.half()).all()


def test_the_model_loss_is_chunked_by_default_under_autocast(monkeypatch):
    monkeypatch.setattr(loss_lib.ProjectedSmoothedLoss, "CHUNK", 4)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    src = torch.randint(4, VOCAB, (2, 6))
    tgt_in, labels = torch.randint(4, VOCAB, (2, 5)), torch.randint(4, VOCAB, (2, 5))
    want = loss_lib.SmoothedLoss(model, EPS, chunked=False)(src, tgt_in, labels, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16), Ops() as ops:
        loss = loss_lib.SmoothedLoss(model, EPS)(src, tgt_in, labels, 10)
        loss.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(want.item(), rel=2e-2)
    assert ops.rows_of(torch.float32, VOCAB) == 4  # a chunk's logits: never the [10, V] of the 10 real tokens
    assert model.embedding.weight.grad.dtype == torch.float32


# --- (c) torch's F.linear_cross_entropy, and a torch without it ------------------------------------------------------

@pytest.mark.skipif(not HAS_TORCH_LOSS, reason="this torch has no F.linear_cross_entropy")
@pytest.mark.parametrize("eps", [0.0, EPS])
def test_the_path_through_torchs_linear_cross_entropy_agrees_with_the_reference(eps):
    hidden, weight, targets = inputs()
    want = reference(hidden, weight, targets, eps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torch that cannot chunk label smoothing says so, and computes it whole
        got = loss_and_grads(lambda h, w: loss_lib.projected_smoothed_loss(h, w, targets, eps, path="torch"),
                             hidden, weight)
    assert got[0].dtype == torch.float32
    for g, w, what in zip(got, want, ("loss", "grad hidden", "grad weight")):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=what)


@pytest.mark.parametrize("has_it", [True, False], ids=["torch with F.linear_cross_entropy", "torch without it"])
def test_the_gpu_choice_runs_with_and_without_torchs_loss(monkeypatch, has_it):
    """What a GPU picks (torch's where it serves, else ours), run here: eps = 0, fp32, which torch 2.13 chunks."""
    if has_it and not HAS_TORCH_LOSS:
        pytest.skip("this torch has no F.linear_cross_entropy")
    if not has_it:
        monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    serves = torch_loss.serves(CPU, None, 0.0)
    assert serves == has_it  # a torch that has it chunks eps = 0 in fp32
    hidden, weight, targets = inputs()
    want = reference(hidden, weight, targets, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the path chosen computes chunked: no fall-through warning
        got = loss_and_grads(lambda h, w: loss_lib.projected_smoothed_loss(h, w, targets, 0.0,
                                                                           path="torch" if serves else "ours"),
                             hidden, weight)
    for g, w, what in zip(got, want, ("loss", "grad hidden", "grad weight")):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=what)
    cuda = torch.device("cuda", 0)
    if not has_it:
        assert torch_loss.loss_path(cuda, torch.bfloat16, EPS) == "ours"  # probes nothing: no CUDA needed


def test_loss_path_takes_torchs_on_gpus_only_where_it_serves_and_never_on_cpus(monkeypatch):
    cuda = torch.device("cuda", 0)
    for serves in (True, False):
        monkeypatch.setattr(torch_loss, "serves", lambda device, dtype, eps, serves=serves: serves)
        assert torch_loss.loss_path(cuda, torch.bfloat16, EPS) == ("torch" if serves else "ours")
        assert torch_loss.loss_path(CPU, None, EPS) == "ours"  # measured slower there (loss_path's docstring)


@pytest.mark.parametrize("flaw", ["falls through to the whole logits", "returns a bf16 sum", "raises"])
def test_torchs_loss_serves_only_if_it_chunks_and_sums_in_fp32(monkeypatch, flaw):
    def fake(hidden, weight, targets, **kwargs):
        if flaw == "raises":
            raise TypeError("unexpected keyword argument 'options'")
        if flaw == "falls through to the whole logits":
            warnings.warn("linear_cross_entropy: ``options`` ignored")
        loss = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
        return loss.bfloat16() if flaw == "returns a bf16 sum" else loss.float()

    monkeypatch.setattr(F, "linear_cross_entropy", fake, raising=False)
    monkeypatch.setattr(torch.nn, "LinearCrossEntropyOptions", lambda **kwargs: None, raising=False)
    assert not torch_loss.serves(CPU, torch.bfloat16, EPS)


# --- (d) the fused chunk (GPUs: compiled), and validation chunked ----------------------------------------------------

@pytest.fixture
def compiled_with(monkeypatch):
    """Compile the fused chunk with `backend` (aot_eager: dynamo and AOT autograd, aten kernels, no C++ build)."""
    def use(backend: str) -> None:
        monkeypatch.setattr(loss_lib.ProjectedSmoothedLoss, "COMPILE_BACKEND", backend)
        monkeypatch.setattr(loss_lib, "_fused_failed", False)
        loss_lib._compiled_chunk.cache_clear()
        torch._dynamo.reset()

    yield use
    loss_lib._compiled_chunk.cache_clear()
    torch._dynamo.reset()


TOLERANCES = {None: dict(loss=1e-5, grad=1e-5), torch.bfloat16: dict(loss=1e-2, grad=0.05),
              torch.float16: dict(loss=1e-2, grad=0.05)}  # as (a) and (b) above


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_compiled_fused_chunk_equals_cross_entropy(compiled_with, dtype):
    compiled_with("aot_eager")
    hidden, weight, targets = inputs()
    want = reference(hidden, weight, targets)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to eager
        got = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, dtype, CHUNK, True,
                                                                                True), hidden, weight)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # full chunks: one graph, reused
    tol = TOLERANCES[dtype]
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=tol["loss"], atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=tol["grad"], atol=tol["grad"] * float(w.abs().max()))


def test_the_fused_chunk_falls_back_to_eager_with_one_warning_if_it_cannot_compile(compiled_with):
    compiled_with("no-such-backend")
    hidden, weight, targets = inputs()
    eager = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, None, CHUNK),
                           hidden, weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, None, CHUNK,
                                                                                    True, True), hidden, weight)
    assert [str(w.message)[:35] for w in caught] == ["the fused loss chunk did not compil"]
    assert all(torch.equal(g, e) for g, e in zip(got, eager))  # the eager chunk, exactly


def valid_setup(tmp_path):
    from pipeline.training.loader import TrainingData

    data = TrainingData.load(*write_corpus(tmp_path, n_valid=40))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    return model, data.valid_share(0, 1, MODEL["max_positions"], CPU)[0]


def whole_logits_validation(model, batches, autocast) -> dict[str, float]:
    """Validation as it was computed with the whole [N, V] logits of every batch (log_softmax in fp32)."""
    smoothed = nll = tokens = 0.0
    with torch.no_grad():
        for b in batches:
            with autocast:
                hidden, targets = loss_lib.real_hidden(model, b.src, b.tgt_in, b.labels, b.tokens)
                logits = model.project(hidden).float()
            nll += F.cross_entropy(logits, targets, reduction="sum").item()
            smoothed += F.cross_entropy(logits, targets, label_smoothing=EPS, reduction="sum").item()
            tokens += b.tokens
    return {"valid_loss": smoothed / tokens, "valid_nll": nll / tokens, "valid_ppl": math.exp(nll / tokens)}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16 autocast"])
def test_validation_computes_the_loss_chunked_and_equals_the_whole_logits(tmp_path, monkeypatch, dtype):
    from pipeline.device import distributed
    from pipeline.training.validation import validate

    monkeypatch.setattr(loss_lib.ProjectedSmoothedLoss, "CHUNK", 4)
    model, batches = valid_setup(tmp_path)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    want = whole_logits_validation(model, batches, autocast)
    with Ops() as ops:
        got = validate(model, batches, EPS, distributed.Dist(0, 1, 0, CPU), autocast)
    rel = 1e-6 if dtype is None else 1e-2
    assert got == pytest.approx(want, rel=rel)
    largest = max(b.tokens for b in batches)
    assert largest > 4 and ops.rows_of(torch.float32, VOCAB) == 4  # a chunk's logits, not a batch's [N, V]
    if dtype:
        assert ops.rows_of(dtype, VOCAB) == 4


# --- (e) GPUs: the last chunk's rows rounded up to a grain, so its products take a few shapes ------------------------

GRAIN = 8


@pytest.mark.parametrize("n", [0, 5, 16, 17, 32, 50, 63])
def test_windows_count_every_row_once_in_a_few_shapes(n):
    windows = loss_lib.windows(n, CHUNK, GRAIN)
    counted = [row for start, stop, skip in windows for row in range(start + skip, stop)]
    assert counted == list(range(n))  # each row once, in order
    for start, stop, skip in windows:
        assert 0 <= skip < stop - start
        assert stop - start in (CHUNK, *range(GRAIN, CHUNK, GRAIN))  # under a grain too: padded in front
        assert start >= 0 or (start + skip == 0 and len(windows) == 1)  # padding only before a lone window
    assert loss_lib.windows(n, CHUNK) == [(s, min(s + CHUNK, n), 0) for s in range(0, n, CHUNK)]  # grain 0: as it is
    assert loss_lib.row_grain(CPU) == 0 and loss_lib.row_grain(torch.device("cuda")) == loss_lib.ProjectedSmoothedLoss.ROW_GRAIN


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_grain_leaves_the_loss_and_its_gradients_as_they_were(dtype):
    hidden, weight, targets = inputs()  # N = 50: chunks of 16 rows, then 2 rows, taken as the last 8 (6 skipped)
    want = reference(hidden, weight, targets)
    plain = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, dtype, CHUNK),
                           hidden, weight)
    with Ops() as ops:
        got = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, dtype, CHUNK, True,
                                                                                False, GRAIN), hidden, weight)
    rows = {shape[0] for name, ins, _ in ops.ops if name == "mm" for _, shape in ins[:1]}
    assert {CHUNK, GRAIN} <= rows <= {CHUNK, GRAIN, V}  # h @ W^T and g @ W: chunk or grain rows; g^T @ h: V rows
    tol = TOLERANCES[dtype]
    for g, p, w in zip(got, plain, want):
        torch.testing.assert_close(g, p, rtol=tol["grad"] / 10, atol=1e-5 * float(w.abs().max()))  # the plain chunks'
        torch.testing.assert_close(g, w, rtol=tol["grad"], atol=tol["grad"] * float(w.abs().max()))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_last_window_of_a_grain_takes_the_fused_chunk_too_counting_each_row_once(compiled_with, dtype):
    """N = 50, chunks of 16 then the last 8 rows (6 counted before): both shapes through the compiled fused chunk,
    one graph each (the skipped rows stay out of the graph: zeroed and left out of the sum after it), the loss
    and gradients those of cross-entropy; no eager chunk, no warning."""
    compiled_with("aot_eager")
    hidden, weight, targets = inputs()
    want = reference(hidden, weight, targets)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    chunk = loss_lib._chunk
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error")  # no fallback to eager
        patch.setattr(loss_lib, "_chunk", lambda *a: pytest.fail(f"an eager chunk of {len(a[1])} rows"))
        got = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, dtype, CHUNK, True,
                                                                                True, GRAIN), hidden, weight)
    assert loss_lib._chunk is chunk
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2  # 16 rows and 8 rows
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got[0], want[0], rtol=tol["loss"], atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=tol["grad"], atol=tol["grad"] * float(w.abs().max()))


@pytest.mark.parametrize("d_model", [512, 1024], ids=["base", "big"])
def test_a_gpu_share_of_a_paper_step_takes_one_fused_graph_padded_in_front(compiled_with, d_model):
    """A rank's 1/8 of the paper's step (25061 target tokens: ~3133 rows, under the GPU's 4096-row chunk) with the
    GPU's chunk and grain: two shares of different sizes, each padded in front to 3584 rows (7 grains), both
    through one compiled graph; loss and gradients those of cross-entropy over the real rows alone."""
    compiled_with("aot_eager")
    chunk, grain = loss_lib.ProjectedSmoothedLoss.GPU_CHUNK, loss_lib.ProjectedSmoothedLoss.ROW_GRAIN
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in (25061 // 8, 3100):
        g = torch.Generator().manual_seed(n)
        hidden, weight = torch.randn(n, d_model, generator=g), torch.randn(64, d_model, generator=g) * d_model**-0.5
        targets = torch.randint(0, 64, (n,), generator=g)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loss_lib, "_chunk", lambda *a: pytest.fail(f"an eager chunk of {len(a[1])} rows"))
            got = loss_and_grads(lambda h, w: loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, None, chunk,
                                                                                    True, True, grain), hidden, weight)
        assert got[1].shape == hidden.shape  # the padding's gradient rows dropped
        for a, b in zip(got, reference(hidden, weight, targets)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # 3584 rows, both shares


@pytest.mark.parametrize("n, rows", [(N, {CHUNK, GRAIN}), (13, {2 * GRAIN})], ids=["chunks", "under a chunk"])
def test_validation_with_a_grain_sums_each_row_once(monkeypatch, n, rows):
    hidden, weight, targets = inputs()
    hidden, targets = hidden[:n], targets[:n]
    want = loss_lib.projected_smoothed_and_nll(hidden, weight, targets, EPS)
    monkeypatch.setattr(loss_lib, "row_grain", lambda device: GRAIN)
    with Ops() as ops:
        got = loss_lib.projected_smoothed_and_nll(hidden, weight, targets, EPS)
    assert {ins[0][1][0] for name, ins, _ in ops.ops if name == "mm"} == rows
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0.0)
