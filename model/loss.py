"""The training loss of Sec. 5.4: label-smoothed cross-entropy over the real target tokens.

The output projection is the shared embedding matrix (Sec. 3.4), so the loss takes the decoder's hidden states
and that matrix, and the [N, V] logits are never held whole, on CPUs and GPUs alike: projected_smoothed_loss,
which model/torch_loss.py's loss_path routes to ProjectedSmoothedLoss (ours, chunk by chunk of rows, its matrix
products in autocast's precision) or to torch's F.linear_cross_entropy where that computes this loss chunked.
On GPUs ours computes each chunk, the last one's rows rounded up to a multiple of ROW_GRAIN (padded in front
under one chunk), with one compiled function (fused_chunk: a few passes over the chunk's logits, not ten; a
graph per window shape, a bounded few); on CPUs eagerly. Validation's loss and NLL are chunked the same way,
without gradients (projected_smoothed_and_nll). R-Drop (train.rdrop_alpha > 0, model/rdrop.py) is the
exception: its KL term needs both passes' whole distributions, so SmoothedLoss then builds the [2N, V] logits.
Nothing here reads a tensor's value or copies a Python number to the device: a GPU step never waits on the
host (tests/training/test_step_syncs.py).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from model import rdrop, torch_loss
from model.transformer import Transformer


def real_hidden(model: Transformer, src: Tensor, tgt_in: Tensor, labels: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """Decoder outputs [N, D] and labels [N] of the N = `tokens` real (non-pad) target positions only.

    The output projection (V x D per position, the largest matrix product for a
    small model) is then computed only where there is a token to predict. N
    comes from the host (the loader counts it), so selecting the positions
    never waits for the GPU as a boolean mask's unknown size would.
    """
    memory, src_mask = model.encode(src)
    return real_rows(model.decode(tgt_in, memory, src_mask), labels, model.pad_id, tokens)


def real_rows(hidden: Tensor, labels: Tensor, pad_id: int, tokens: int) -> tuple[Tensor, Tensor]:
    """hidden [B, T, D] and labels [B, T] at their N = `tokens` real (non-pad) positions: [N, D], [N]."""
    real = torch.nonzero_static((labels != pad_id).flatten(), size=tokens)[:, 0]  # row-major, as hidden[mask]
    return hidden.flatten(0, 1)[real], labels.flatten()[real]


def low_precision(device: torch.device) -> torch.dtype | None:
    """The low precision (bf16 / fp16) autocast runs matrix products in on `device` here, None where it is off.

    (Not pipeline.device.distributed.autocast_dtype, which picks the precision a device trains in.)
    """
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
    return None


def chunk_rows(device: torch.device) -> int:
    """Rows per chunk: a chunk holds [rows, V] fp32 (and, under autocast, a bf16 / fp16 copy of it).

    512 on CPUs (measured best there, see ProjectedSmoothedLoss.CHUNK); 4096 on
    GPUs, where a [4096, D] x [D, V] product fills the GPU: at V = 37000 a chunk
    is 0.6 GB fp32 + 0.3 GB bf16, where the whole logits of N = 26400 rows were
    3.9 GB (bf16 logits and their fp32 copies).
    """
    return ProjectedSmoothedLoss.CHUNK if device.type == "cpu" else ProjectedSmoothedLoss.GPU_CHUNK


def row_grain(device: torch.device) -> int:
    """Rows the last, shorter chunk is rounded up to on `device` (windows): ROW_GRAIN on GPUs, 0 (as it is) on CPUs."""
    return 0 if device.type == "cpu" else ProjectedSmoothedLoss.ROW_GRAIN


def windows(n: int, chunk: int, grain: int = 0) -> list[tuple[int, int, int]]:
    """(start, stop, skip) of each chunk of n rows: full chunks of `chunk` rows, then the rest, r rows.

    grain 0: the rest as it is, (n - r, n, 0). grain > 0: the last r rows rounded up to a multiple of grain,
    the first `skip` counted by the chunk before (left out by the caller), so the products take one of chunk /
    grain shapes (a GEMM shape new to a GPU held its host 2.8 to 27 ms: docs/benchmarks.md), not one per step.
    Under one chunk (a GPU's 1/8 share of a step: ~3.1k of 4096 rows) the window starts before row 0: its first
    `skip` rows are padding the caller puts in front (front_padded).
    """
    out = [(start, start + chunk, 0) for start in range(0, n - chunk + 1, chunk)]
    rest = n - len(out) * chunk
    if rest:
        rows = -(-rest // grain) * grain if grain else rest
        out.append((n - rows, n, rows - rest))
    return out


def front_padded(hidden: Tensor, targets: Tensor, spans: list[tuple[int, int, int]]
                 ) -> tuple[Tensor, Tensor, list[tuple[int, int, int]], int]:
    """hidden [N, D], targets [N] and their windows with `pad` zero rows (target 0) put in front where the first
    window starts before row 0 (windows), so every window is a slice; pad (0: all as they were). The padding is
    that window's `skip`: out of the sum, its gradient rows zero."""
    pad = -spans[0][0] if spans and spans[0][0] < 0 else 0
    if not pad:
        return hidden, targets, spans, 0
    hidden = torch.cat([hidden.new_zeros(pad, hidden.shape[1]), hidden])
    targets = torch.cat([targets.new_zeros(pad), targets])
    return hidden, targets, [(start + pad, stop + pad, skip) for start, stop, skip in spans], pad


class ProjectedSmoothedLoss(torch.autograd.Function):
    """sum over rows of label-smoothed cross-entropy(hidden @ weight^T, targets), gradients taken chunk by chunk.

    The same function as F.cross_entropy(model.project(hidden), targets,
    label_smoothing, reduction="sum"), but the [N, V] logits never exist whole:
    each chunk of rows is projected, its loss and its logit gradient
    softmax(z) - q (q = (1 - eps) one_hot + eps / V, the smoothed target of Sec.
    5.4) taken at once and pushed through the two matrix products; backward only
    scales the stored gradients. On a 2-core CPU this part of the step takes
    ~40% less time (no log_softmax backward, no [N, V] temporaries).

    `dtype` (bf16 / fp16: autocast's, see projected_smoothed_loss) runs the three
    matrix products h @ W^T, g @ W and g^T @ h in that precision, as autocast
    would run the projection; the log-sum-exp, softmax, the loss sum (fp64) and
    the weight gradient's sum over chunks stay fp32. None (fp32 training, CPUs):
    everything in the inputs' dtype. In fp16 the logit gradient is scaled by a
    power of two per chunk before the products (its eps / V entries would be
    fp16 subnormals, and no loss scale reaches a gradient taken in forward) and
    unscaled in fp32, exactly. `grads` False (no gradient wanted) skips the
    gradients. `grain` > 0 rounds the last chunk's rows up to a multiple of it
    (windows; GPUs), 0 takes them as they are (CPUs, the same bits as before).
    """

    CHUNK = 512  # rows per chunk: measured best on a 2-core CPU for V = 8000 (256: +3%, 1024: +1%)
    GPU_CHUNK = 4096  # rows per chunk on GPUs: chunk_rows
    ROW_GRAIN = 512  # on GPUs the last chunk's rows are a multiple of this (windows): 8 shapes, not 4096
    COMPILE_BACKEND = "inductor"  # torch.compile's backend for the fused chunk (tests: aot_eager, no C++ build)

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float,
                dtype: torch.dtype | None = None, chunk: int | None = None, grads: bool = True,
                fused: bool = False, grain: int = 0) -> Tensor:
        eps, chunk = label_smoothing, chunk or ProjectedSmoothedLoss.CHUNK
        w = weight if dtype is None else weight.to(dtype)  # [V, D], cast once (as autocast casts it per product)
        loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
        hidden, targets, spans, pad = front_padded(hidden, targets, windows(hidden.shape[0], chunk, grain))
        grad_hidden = torch.empty_like(hidden) if grads else None
        # The weight gradient summed over chunks in fp32 at least (for fp32 weights: zeros_like(weight), as before).
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if grads else None
        for start, stop, skip in spans:
            h = hidden[start:stop]  # [n, D]
            y = targets[start:stop]
            if dtype is not None:
                h = h.to(dtype)
            z = h @ w.t()  # [n, V]: the product in bf16 / fp16 (all that follows it in fp32), or fp32
            if fused and grads and (len(y) == chunk or (grain and len(y) % grain == 0)):  # chunk / grain shapes
                part, g, scale = _fused(z, y, eps, dtype, h, w, skip)
            else:
                part, g, scale = _chunk(z.float(), y, eps, dtype, h, w, grads, skip)
            loss += part.double()
            if not grads:
                continue
            rows = slice(start + skip, stop)  # g's first `skip` rows are zero: they add nothing to grad_weight
            if dtype is None:
                grad_hidden[rows] = (g @ weight)[skip:]
                grad_weight.addmm_(g.t(), h)
            elif scale is not None:  # fp16: g was scaled by a power of two, unscaled here in fp32, exactly
                grad_hidden[rows] = (g @ w)[skip:].float().div_(scale)
                grad_weight.addcdiv_(g.t() @ h, scale)  # fp16 product, unscaled and summed in fp32
            else:
                grad_hidden[rows] = (g @ w)[skip:]
                grad_weight.add_(g.t() @ h)  # bf16 product, summed over chunks in fp32
        ctx.weight_dtype = weight.dtype
        if grads:
            ctx.save_for_backward(grad_hidden[pad:], grad_weight)
        return loss.to(torch.promote_types(hidden.dtype, torch.float32))  # fp32 for bf16 / fp16 hidden states too

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None, None, None, None, None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        nones = (None,) * 7  # targets, label_smoothing, dtype, chunk, grads, fused, grain
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), *nones


def _softmax_terms(z: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(e, total, lse, z_y, mean z) of fp32 logits z [n, V], e = exp(z - max z) in place of z, total its row sums."""
    z_y, z_mean, z_max = z.gather(1, y[:, None])[:, 0], z.mean(dim=-1), z.amax(dim=-1, keepdim=True)
    e = z.sub_(z_max).exp_()  # exp(z - max z), in place of z
    total = e.sum(dim=-1, keepdim=True)
    lse = (z_max + total.log())[:, 0]
    return e, total, lse, z_y, z_mean


def _chunk(z: Tensor, y: Tensor, eps: float, dtype: torch.dtype | None, h: Tensor, w: Tensor,
           grads: bool, skip: int = 0) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One chunk's loss sum, logit gradient (None without `grads`) and fp16 scale, eagerly, in place of z [n, V] fp32.

    The first `skip` rows (counted by the chunk before, see windows) add
    nothing: left out of the sum, their gradient rows zero.

    -sum_k q_k log softmax(z)_k = lse - (1 - eps) z_y - eps mean_k z_k; the
    gradient softmax(z) - q. Every constant is a Python number given to the op
    that uses it: a tensor made from one on the host is a copy the host waits for
    on a GPU.
    """
    e, total, lse, z_y, z_mean = _softmax_terms(z, y)
    loss = (lse - (1 - eps) * z_y - eps * z_mean)[skip:].sum()
    if not grads:
        return loss, None, None
    minus = torch.full((), -eps / z.shape[1], dtype=e.dtype, device=e.device)  # a fill on the device, no copy
    g = torch.addcmul(minus, e, total.reciprocal(), out=e)  # softmax(z) - eps / V
    g[torch.arange(len(y), device=g.device), y] -= 1 - eps
    if skip:
        g[:skip] = 0
    return (loss, *_in_product_dtype(g, dtype, h, w))


def fused_chunk(z: Tensor, y: Tensor, eps: float, dtype: torch.dtype | None, h: Tensor,
                w: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """_chunk's loss per row [n], logit gradient and fp16 scale as one function of the logits z [n, V] (the product's
    dtype); the caller sums the rows it counts (_fused).

    Written for torch.compile (_fused): no in-place updates of z and the
    one-hot target as a comparison, so the compiler makes of it a few passes
    over z (its maxima, the sums of exp, then the gradient, written once in the
    products' dtype) instead of _chunk's ten eager ones, still all in fp32.
    """
    z = z.float()
    z_max = z.amax(dim=-1, keepdim=True)
    lse = z_max + (z - z_max).exp().sum(dim=-1, keepdim=True).log()  # [n, 1]
    loss = lse[:, 0] - (1 - eps) * z.gather(1, y[:, None])[:, 0] - eps * z.mean(dim=-1)
    target = torch.arange(z.shape[1], device=z.device) == y[:, None]  # [n, V], the one-hot
    g = (z - lse).exp() - eps / z.shape[1]
    return (loss, *_in_product_dtype(torch.where(target, g - (1 - eps), g), dtype, h, w))


def _in_product_dtype(g: Tensor, dtype: torch.dtype | None, h: Tensor, w: Tensor) -> tuple[Tensor, Tensor | None]:
    """The fp32 logit gradient g as the products take it: (g, None) for fp32, cast for bf16; fp16: (s g, s)."""
    if dtype == torch.float16:
        scale = _fp16_scale(g, h, w)
        return g.mul_(scale).to(dtype), scale
    return (g if dtype is None else g.to(dtype)), None


def _fp16_scale(g: Tensor, h: Tensor, w: Tensor) -> Tensor:
    """A power of two s (a 0-dim fp32 tensor, no host sync) for fp16 products of s * g, g the fp32 logit gradient.

    |g| <= 1 and each row's sum of |g| is <= 2, so |s g @ W| <= 2 s max|W| and
    |s g^T @ h| <= s max_k(sum_rows |g_k|) max|h|: s is the largest power of two
    keeping both, and s g itself, under 2^15 (fp16's largest is 65504): the
    gradient's small entries (eps / V, ~3e-6: fp16 subnormals) keep their
    11 bits where the products allow it.
    """
    bound = torch.maximum(2 * w.abs().amax().float(), g.abs().sum(dim=0).amax() * h.abs().amax().float())
    return torch.exp2(torch.floor(torch.log2(2.0**15 / bound.clamp(min=1.0))))


_fused_failed = False  # compiling fused_chunk failed once: eager from then on


@functools.cache
def _compiled_chunk(backend: str):
    """fused_chunk compiled for static shapes: one graph per chunk shape and precision, built on its first call."""
    return torch.compile(fused_chunk, backend=backend, dynamic=False, fullgraph=True)


def _fused(z: Tensor, y: Tensor, eps: float, dtype: torch.dtype | None, h: Tensor,
           w: Tensor, skip: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
    """fused_chunk compiled (its loss summed over the rows after the first `skip`, whose gradient rows are zeroed:
    the last window's rows counted by the chunk before, see windows); if compiling fails, _chunk eagerly, then and
    for the rest of the process (one warning). The compiled graphs: one per window shape (the chunk, and the last
    window's multiples of ROW_GRAIN: a bounded few) and precision; `skip` stays out of them.

    Eager too, with no warning, under a dispatch mode (FlopCounterMode, an op
    recorder), where torch.compile does not run.
    """
    global _fused_failed
    if not _fused_failed and _get_current_dispatch_mode() is None:
        try:
            rows, g, scale = _compiled_chunk(ProjectedSmoothedLoss.COMPILE_BACKEND)(z, y, eps, dtype, h, w)
            if skip:
                g[:skip] = 0
            return rows[skip:].sum(), g, scale
        except torch._dynamo.exc.TorchDynamoException as e:
            _fused_failed = True
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            warnings.warn(f"the fused loss chunk did not compile (torch.compile, backend "
                          f"{ProjectedSmoothedLoss.COMPILE_BACKEND}); computing it eagerly: {type(e).__name__}: {reason}")
    return _chunk(z.float(), y, eps, dtype, h, w, True, skip)


def projected_smoothed_loss(hidden: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float,
                            path: str | None = None) -> Tensor:
    """Summed label-smoothed cross-entropy of hidden @ weight^T ([N, D] x [V, D]) against targets, logits never whole.

    Follows autocast: on where the call is, the matrix products run in its
    bf16 / fp16 and the sums in fp32; off (CPU training), all in fp32 as
    before, to the bit. The loss is fp32 (or hidden's dtype, if wider).
    `path` ("torch" / "ours") overrides loss_path's choice (tests). On GPUs
    ours computes its chunks with the compiled fused_chunk (the last one's
    rows rounded up to ROW_GRAIN, padded in front under one chunk: windows); on CPUs
    eagerly, chunk by chunk as before (compiled, a CPU gives other bits and no
    speed: docs/benchmarks.md).
    """
    device, dtype = hidden.device, low_precision(hidden.device)
    with torch.autocast(device.type, enabled=False):  # the precision is chosen here, explicitly
        if (path or torch_loss.loss_path(device, dtype, label_smoothing)) == "torch":
            return torch_loss.summed(hidden, weight, targets, label_smoothing, dtype, chunk_rows(device)).float()
        grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        return ProjectedSmoothedLoss.apply(hidden if dtype is not None else hidden.float(), weight, targets,
                                           label_smoothing, dtype, chunk_rows(device), grads, device.type != "cpu",
                                           row_grain(device))


class SmoothedLoss(nn.Module):
    """The model with its training loss: label-smoothed cross-entropy summed over real target tokens (Sec. 5.4).

    # Paper: eps_ls = 0.1 (Sec. 5.4) with the smoothing of its reference (Szegedy et al. 2016): target
    # (1 - eps) one_hot + eps / V, the uniform part over all V ids, PAD, UNK and BOS included (as
    # F.cross_entropy's label_smoothing). tensor2tensor gives the true token 1 - eps and eps / (V - 1)
    # to each other id: a difference of eps / V, 2.7e-6 at V = 37000.

    `rdrop_alpha` > 0 runs each training batch twice, or its share `rdrop_fraction` of the rows (model/rdrop.py,
    whole logits); evaluation runs it once.
    `chunked` (the default, CPUs and GPUs alike) computes the projection and the
    loss with projected_smoothed_loss, chunk by chunk, in autocast's precision
    where autocast is on; False builds the whole logits, model.project() then
    F.cross_entropy, whose precision autocast manages (bf16 logits, fp32 loss),
    kept to compare the two.
    `padded` (train.compile_scope = step, pipeline/device/compiled.py) projects every position of the batch,
    padding included, and leaves the padding out of the sum (F.cross_entropy's ignore_index): the same loss,
    a function of the batch's tensors alone (no count of real tokens, no row selection of an unknown size),
    so one compiled graph of the whole forward serves every shape; its [B x T, V] logits are whole, for the
    compiler to fuse (pipeline/training/plan.py counts their memory). Not with R-Drop.
    """

    def __init__(self, model: Transformer, label_smoothing: float, chunked: bool = True, rdrop_alpha: float = 0.0,
                 rdrop_fraction: float = 1.0, padded: bool = False):
        super().__init__()
        self.model, self.label_smoothing, self.chunked = model, label_smoothing, chunked
        self.rdrop_alpha = rdrop_alpha  # > 0: R-Drop in training (model/rdrop.py)
        self.rdrop_fraction = rdrop_fraction  # of each batch's rows that pass twice
        if padded and rdrop_alpha > 0:
            raise ValueError("SmoothedLoss(padded=True) computes the plain loss: R-Drop (rdrop_alpha > 0) needs "
                             "the real rows (padded=False)")
        self.padded = padded

    def forward(self, src: Tensor, tgt_in: Tensor, labels: Tensor, tokens: int | None = None) -> Tensor:
        if self.padded:
            return self.over_padding(src, tgt_in, labels)
        if not (self.rdrop_alpha > 0 and self.model.training):
            return self.plain(*real_hidden(self.model, src, tgt_in, labels, tokens))
        pairs = rdrop.paired_rows(src.shape[0], self.rdrop_fraction, src.device)
        if pairs is None:  # each pair twice, with two dropout masks
            hidden, targets = real_hidden(self.model, torch.cat([src, src]), torch.cat([tgt_in, tgt_in]),
                                          torch.cat([labels, labels]), 2 * tokens)
            return rdrop.rdrop_loss(self.model.project(hidden), targets, self.label_smoothing, self.rdrop_alpha)
        # Those rows twice, with two dropout masks: their second passes after the batch.
        rows = src.shape[0]
        memory, src_mask = self.model.encode(torch.cat([src, src[pairs]]))
        hidden = self.model.decode(torch.cat([tgt_in, tgt_in[pairs]]), memory, src_mask)  # [B + k, T, D]
        once = self.plain(*real_rows(hidden[:rows], labels, self.model.pad_id, tokens))
        return once + rdrop.pair_terms(self.model.project(hidden[pairs]), self.model.project(hidden[rows:]),
                                       labels[pairs], self.model.pad_id, self.label_smoothing, self.rdrop_alpha)

    def over_padding(self, src: Tensor, tgt_in: Tensor, labels: Tensor) -> Tensor:
        """The summed label-smoothed CE over every position of [B, T] labels, the padding left out (`padded`)."""
        memory, src_mask = self.model.encode(src)
        logits = self.model.project(self.model.decode(tgt_in, memory, src_mask).flatten(0, 1))  # [B x T, V]
        return F.cross_entropy(logits.float(), labels.flatten(), ignore_index=self.model.pad_id,
                               label_smoothing=self.label_smoothing, reduction="sum")

    def plain(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """The summed label-smoothed CE of real positions' decoder outputs [N, D] and labels [N]."""
        if self.chunked:
            # model.project() is hidden @ embedding.weight^T (Sec. 3.4); test_train checks the two agree.
            return projected_smoothed_loss(hidden, self.model.embedding.weight, targets, self.label_smoothing)
        logits = self.model.project(hidden)
        return F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing, reduction="sum")


def projected_smoothed_and_nll(hidden: Tensor, weight: Tensor, targets: Tensor,
                               label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed plain NLL of hidden @ weight^T, chunk by chunk, no gradients.

    What validation reports: the [N, V] logits never whole (only chunk_rows of
    them at a time), the products in autocast's precision where the call is under
    autocast, the log-sum-exp and the sums in fp32, each chunk's added in fp64.
    Returns two 0-dim fp64 tensors (smoothed, nll), read by the caller when it needs them.
    """
    device, dtype = hidden.device, low_precision(hidden.device)
    compute, eps = dtype or torch.float32, label_smoothing
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # smoothed, nll
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        w = weight.to(compute)  # [V, D]
        hidden, targets, spans, _ = front_padded(hidden, targets, windows(hidden.shape[0], chunk_rows(device),
                                                                          row_grain(device)))
        for start, stop, skip in spans:
            h = hidden[start:stop].to(compute)  # [n, D]
            y = targets[start:stop]
            _, _, lse, z_y, z_mean = _softmax_terms((h @ w.t()).float(), y)  # [n, V] fp32, in place
            sums[0] += (lse - (1 - eps) * z_y - eps * z_mean)[skip:].sum().double()
            sums[1] += (lse - z_y)[skip:].sum().double()
    return sums[0], sums[1]
