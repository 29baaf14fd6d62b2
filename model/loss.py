"""The training loss of Sec. 5.4: label-smoothed cross-entropy over the real target tokens.

The output projection is the shared embedding matrix (Sec. 3.4), so the loss
takes the decoder's hidden states and that matrix, and the [N, V] logits are
never held whole, on CPUs and GPUs alike: projected_smoothed_loss, which
loss_path routes to ProjectedSmoothedLoss (ours, chunk by chunk of rows, its
matrix products in autocast's precision) or to torch's F.linear_cross_entropy
where that computes this loss chunked.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.transformer import Transformer


def real_hidden(model: Transformer, src: Tensor, tgt_in: Tensor, labels: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """Decoder outputs [N, D] and labels [N] of the N = `tokens` real (non-pad) target positions only.

    The output projection (V x D per position, the largest matrix product for a
    small model) is then computed only where there is a token to predict. N
    comes from the host (the loader counts it), so selecting the positions
    never waits for the GPU as a boolean mask's unknown size would.
    """
    memory, src_mask = model.encode(src)
    hidden = model.decode(tgt_in, memory, src_mask)  # [B, T, D]
    real = torch.nonzero_static((labels != model.pad_id).flatten(), size=tokens)[:, 0]  # row-major, as hidden[mask]
    return hidden.flatten(0, 1)[real], labels.flatten()[real]  # [B, T, D] -> [N, D]


def low_precision(device: torch.device) -> torch.dtype | None:
    """The low precision (bf16 / fp16) autocast runs matrix products in on `device` here, None where it is off.

    (Not pipeline.training.distributed.autocast_dtype, which picks the precision a device trains in.)
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
    gradients.
    """

    CHUNK = 512  # rows per chunk: measured best on a 2-core CPU for V = 8000 (256: +3%, 1024: +1%)
    GPU_CHUNK = 4096  # rows per chunk on GPUs: chunk_rows

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float,
                dtype: torch.dtype | None = None, chunk: int | None = None, grads: bool = True) -> Tensor:
        eps, V, chunk = label_smoothing, weight.shape[0], chunk or ProjectedSmoothedLoss.CHUNK
        w = weight if dtype is None else weight.to(dtype)  # [V, D], cast once (as autocast casts it per product)
        loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grads else None
        # The weight gradient summed over chunks in fp32 at least (for fp32 weights: zeros_like(weight), as before).
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if grads else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]  # [n, D]
            y = targets[start : start + chunk]
            if dtype is None:
                z = h @ weight.t()  # [n, V]
            else:
                h = h.to(dtype)
                z = (h @ w.t()).float()  # the product in bf16 / fp16, all that follows it in fp32
            z_y, z_mean, z_max = z.gather(1, y[:, None])[:, 0], z.mean(dim=-1), z.amax(dim=-1, keepdim=True)
            e = z.sub_(z_max).exp_()  # exp(z - max z), in place of z
            total = e.sum(dim=-1, keepdim=True)
            lse = (z_max + total.log())[:, 0]
            # -sum_k q_k log softmax(z)_k = lse - (1 - eps) z_y - eps mean_k z_k
            loss += (lse - (1 - eps) * z_y - eps * z_mean).sum().double()
            if not grads:
                continue
            g = torch.addcmul(e.new_tensor(-eps / V), e, total.reciprocal(), out=e)  # softmax(z) - eps / V
            g[torch.arange(len(y), device=g.device), y] -= 1 - eps
            if dtype is None:
                grad_hidden[start : start + len(y)] = g @ weight
                grad_weight.addmm_(g.t(), h)
            elif dtype == torch.float16:
                scale = _fp16_scale(g, h, w)
                g = g.mul_(scale).to(dtype)
                grad_hidden[start : start + len(y)] = (g @ w).float().div_(scale)
                grad_weight.addcdiv_(g.t() @ h, scale)  # fp16 product, unscaled and summed in fp32
            else:
                g = g.to(dtype)
                grad_hidden[start : start + len(y)] = g @ w
                grad_weight.add_(g.t() @ h)  # bf16 product, summed over chunks in fp32
        ctx.weight_dtype = weight.dtype
        if grads:
            ctx.save_for_backward(grad_hidden, grad_weight)
        return loss.to(torch.promote_types(hidden.dtype, torch.float32))  # fp32 for bf16 / fp16 hidden states too

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None, None, None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), None, None, None, None, None


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


@functools.cache
def _torch_chunks_it(device: torch.device, dtype: torch.dtype | None, label_smoothing: float) -> bool:
    """Whether F.linear_cross_entropy computes this loss chunked, returning it in fp32: tried once on a 2 x 2 input.

    Its documented contract: options it cannot honour fall through to the whole
    logits with a warning (torch 2.13 does so for any label_smoothing != 0), and
    bf16 / fp16 inputs give a loss of their dtype (2.13: a bf16 loss sum).
    """
    weight = torch.ones(3, 2, device=device, requires_grad=True)
    hidden = torch.ones(2, 2, device=device, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            targets = torch.zeros(2, dtype=torch.long, device=device)
            loss = _torch_loss(hidden, weight, targets, label_smoothing, dtype, 1)
        except (TypeError, ValueError, RuntimeError, NotImplementedError):
            return False
    return not caught and loss.dtype == torch.float32


def _torch_loss(hidden: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float, dtype: torch.dtype | None,
                chunk: int) -> Tensor:
    """The summed loss by torch's F.linear_cross_entropy, `chunk` rows at a time, its products in `dtype`."""
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=chunk, acc_policy="balanced", acc_dtype=torch.float32)
    dtype = dtype or torch.float32
    return F.linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, reduction="sum",
                                  label_smoothing=label_smoothing, options=options)


def torch_loss_serves(device: torch.device, dtype: torch.dtype | None, label_smoothing: float) -> bool:
    """Whether this torch has F.linear_cross_entropy, computing this loss chunked, summed in fp32 (a feature test)."""
    if not hasattr(F, "linear_cross_entropy") or not hasattr(nn, "LinearCrossEntropyOptions"):
        return False  # torch 2.11 (the GPU machine's) has neither
    return _torch_chunks_it(device, dtype, label_smoothing)


def loss_path(device: torch.device, dtype: torch.dtype | None, label_smoothing: float) -> str:
    """Which code computes the loss on `device` with products in `dtype`: "torch" (F.linear_cross_entropy) or "ours".

    GPUs: torch's own chunked F.linear_cross_entropy where it serves
    (torch_loss_serves: chunked with label smoothing, a fp32 loss sum), else
    ours, ProjectedSmoothedLoss in autocast's precision. torch 2.13 (the lock's)
    chunks only label_smoothing == 0 and returns a bf16 sum for bf16 inputs, and
    torch 2.11 (the GPU machine's) has no F.linear_cross_entropy: so for the
    paper's eps = 0.1 every GPU runs ours today; a torch whose op does serve
    takes it over with no change here.

    CPUs: ours, always: torch's is no faster there, and ours in fp32 is the
    code CPUs trained with before, to the bit (the same weights). Measured on
    the 2-core CPU, shared with other jobs (torch 2.13, one thread, N = 1250,
    D = 256, V = 5000, fp32, forward + backward, 21 interleaved rounds), ms
    median / min:
                                                  eps = 0.1    eps = 0
        ours (512-row chunks)                     203 / 154    205 / 157
        F.linear_cross_entropy, 512-row chunks    241 / 168    216 / 159  (eps = 0.1: not chunked, whole logits)
        F.linear_cross_entropy, its own chunks    243 / 164    355 / 305
        whole logits, F.cross_entropy             249 / 167    221 / 158
    Two threads: the same order, within the shared machine's noise. Under CPU
    bf16 autocast (tests only: CPUs train in fp32), where this AVX2 CPU emulates
    bf16 products, ours takes 6.6 s and the whole logits 6.4 s; torch's, at
    eps = 0 only, 0.3 s (fp32 products inside) but a bf16 loss sum.
    """
    if device.type != "cpu" and torch_loss_serves(device, dtype, label_smoothing):
        return "torch"
    return "ours"


def projected_smoothed_loss(hidden: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float,
                            path: str | None = None) -> Tensor:
    """Summed label-smoothed cross-entropy of hidden @ weight^T ([N, D] x [V, D]) against targets, logits never whole.

    Follows autocast: on where the call is, the matrix products run in its
    bf16 / fp16 and the sums in fp32; off (CPU training), all in fp32 as
    before, to the bit. The loss is fp32 (or hidden's dtype, if wider).
    `path` ("torch" / "ours") overrides loss_path's choice (tests).
    """
    device, dtype = hidden.device, low_precision(hidden.device)
    with torch.autocast(device.type, enabled=False):  # the precision is chosen here, explicitly
        if (path or loss_path(device, dtype, label_smoothing)) == "torch":
            return _torch_loss(hidden, weight, targets, label_smoothing, dtype, chunk_rows(device)).float()
        grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        return ProjectedSmoothedLoss.apply(hidden if dtype is not None else hidden.float(), weight, targets,
                                           label_smoothing, dtype, chunk_rows(device), grads)


class SmoothedLoss(nn.Module):
    """The model with its training loss: label-smoothed cross-entropy summed over real target tokens (Sec. 5.4).

    # Paper: eps_ls = 0.1 (Sec. 5.4) with the smoothing of its reference (Szegedy et al. 2016): target
    # (1 - eps) one_hot + eps / V, the uniform part over all V ids, PAD, UNK and BOS included (as
    # F.cross_entropy's label_smoothing). tensor2tensor gives the true token 1 - eps and eps / (V - 1)
    # to each other id: a difference of eps / V, 2.7e-6 at V = 37000.

    `chunked` (the default, CPUs and GPUs alike) computes the projection and the
    loss with projected_smoothed_loss, chunk by chunk, in autocast's precision
    where autocast is on; False builds the whole logits, model.project() then
    F.cross_entropy, whose precision autocast manages (bf16 logits, fp32 loss),
    kept to compare the two.
    """

    def __init__(self, model: Transformer, label_smoothing: float, chunked: bool = True):
        super().__init__()
        self.model, self.label_smoothing, self.chunked = model, label_smoothing, chunked

    def forward(self, src: Tensor, tgt_in: Tensor, labels: Tensor, tokens: int) -> Tensor:
        hidden, targets = real_hidden(self.model, src, tgt_in, labels, tokens)
        if self.chunked:
            # model.project() is hidden @ embedding.weight^T (Sec. 3.4); test_train checks the two agree.
            return projected_smoothed_loss(hidden, self.model.embedding.weight, targets, self.label_smoothing)
        logits = self.model.project(hidden)
        return F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing, reduction="sum")


def smoothed_and_nll(logits: Tensor, targets: Tensor, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed plain NLL of the same logits."""
    logp = logits.float().log_softmax(dim=-1)
    nll = -logp.gather(1, targets[:, None]).sum()
    uniform = -logp.mean(dim=-1).sum()  # cross-entropy against the uniform distribution over V
    return (1 - label_smoothing) * nll + label_smoothing * uniform, nll
