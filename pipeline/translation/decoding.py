"""The project's decoder over many sentences: batches of alike lengths, searched side by side on the CPU threads.

    outputs = translate_ids(model, sources, cfg)   # output ids (no BOS/EOS) per source, in input order

Used by the translate stage (translate.engine: project) and by the export stage, which checks the CTranslate2
export against it. Each batch is one batched beam search (model/beam_search.py); precision: decoding_precision.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from model.beam_search import Hypothesis, beam_search
from model.flops import DTYPE_NAMES
from model.transformer import Transformer
from pipeline.core.config import ParamsError, TranslateConfig
from pipeline.corpus.formats import BOS_ID, EOS_ID, PAD_ID
from pipeline.translation.lengths import max_source_len, warn_cut
from pipeline.progress import progress_bar
from pipeline.device import precision as training_precision

log = logging.getLogger(__name__)


PRECISIONS = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # translate.precision's dtypes, but auto


def decoding_precision(model: Transformer, setting: str = "auto") -> torch.dtype:
    """Cast `model` in place, once, to translate.precision = `setting`; returns that dtype.

    auto: fp32 on every device, the precision measured never slower: on an H200 bf16 weights decoded at 0.36x to 0.85x
    fp32's sentences/s (python -m bench.decoding.precision, docs/gpu_benchmarks.md), on CPUs fp32 is how they train.
    fp32 / bf16 / fp16 force one; a GPU without bf16 (compute capability below 8.0) refuses bf16 with one line.
    The whole model is cast, as fairseq's generate does with --fp16 (model.half()), not autocast around each step:
    autocast's cast weights are cached only until its block exits, so a step under autocast casts every weight
    again. In bf16 the residual stream and LayerNorm outputs are rounded to bf16; LayerNorm and softmax still
    accumulate in fp32 inside their kernels, and beam search scores fp32 log-probabilities (_next_logits).
    """
    device = model.embedding.weight.device
    dtype = PRECISIONS.get(setting, torch.float32)
    if dtype == torch.bfloat16 and device.type == "cuda" and training_precision.autocast_dtype(device) != torch.bfloat16:
        raise ParamsError(f"translate.precision = 'bf16': this GPU ({torch.cuda.get_device_name(device)}) has no bf16 "
                          "(compute capability 8.0 and newer); set it to 'auto', 'fp32' or 'fp16'")
    model.to(dtype)  # in place: parameters and buffers (nothing to do in fp32)
    return dtype


def decoding_batches(lengths: np.ndarray, max_tokens: int, max_sentences: int) -> list[np.ndarray]:
    """Sentence indices, longest first, in batches of <= max_tokens padded tokens and <= max_sentences sentences."""
    order = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        n = min(max(1, max_tokens // int(lengths[order[start]])), max_sentences)  # the first is the longest
        batches.append(order[start : start + n])
        start += n
    return batches


def parallel_searches(batches: list[np.ndarray], threads: int, cuda: bool) -> tuple[list[np.ndarray], int, int]:
    """(batches to search, searches run at once, torch threads each) for `threads` CPU threads.

    A beam step is hundreds of small operations: torch threads splitting each one
    wait for each other at every one of them (on a busy machine, for whoever
    holds a core), so whole batches run side by side on one thread each instead.
    Each batch is cut into one part per search (its sentences have alike
    lengths, so the parts cost alike): the searches get equal shares whatever
    the number of batches (5 whole batches on 2 threads would idle one thread a
    fifth of the time).
    """
    sentences = sum(len(b) for b in batches)
    if cuda or threads <= 1 or sentences <= 1:
        return batches, 1, threads
    workers = min(threads, sentences)
    parts = [part for batch in batches for part in np.array_split(batch, workers) if len(part)]
    return parts, workers, max(1, threads // workers)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch.set_num_threads(n) for the block, then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def translate_ids(
    model: Transformer, sources: Sequence[np.ndarray], cfg: TranslateConfig, progress: bool = True,
    use_cache: bool = True,
) -> list[list[int]]:
    """Output ids (no BOS/EOS) for each source (ids without EOS), in input order (use_cache: see beam_search)."""
    device = model.embedding.weight.device
    limit = max_source_len(model.max_positions, cfg) - 1  # room for EOS
    if limit < 0:
        raise ParamsError(f"translate.max_len_a = {cfg.max_len_a}, max_len_b = {cfg.max_len_b}: even an empty source's "
                          f"output limit exceeds the model's max_positions = {model.max_positions}")
    lengths = np.fromiter((min(len(s), limit) + 1 for s in sources), dtype=np.int64, count=len(sources))
    warn_cut(sources, limit)

    def search(batch: np.ndarray) -> list[Hypothesis]:
        rows = [torch.from_numpy(np.append(sources[i][:limit].astype(np.int64), EOS_ID)) for i in batch]
        src = pad_sequence(rows, batch_first=True, padding_value=PAD_ID).to(device)  # [B, S]
        return beam_search(model, src, cfg.beam_size, cfg.length_penalty, cfg.max_len_a, cfg.max_len_b, BOS_ID, EOS_ID,
                           use_cache)

    nonempty = np.flatnonzero(np.fromiter((len(s) > 0 for s in sources), dtype=bool, count=len(sources)))
    batches = [nonempty[b] for b in decoding_batches(lengths[nonempty], cfg.max_tokens,
                                                     max(1, cfg.max_tokens // cfg.beam_size))]
    batches, workers, threads = parallel_searches(batches, torch.get_num_threads(), device.type == "cuda")
    outputs: list[list[int]] = [[] for _ in sources]
    with (progress_bar(total=len(sources), unit="sentence", desc="translate", disable=not progress, mininterval=5) as bar,
          torch_threads(threads), ThreadPoolExecutor(workers) as pool):
        bar.update(len(sources) - len(nonempty))  # an empty line is not decoded: its translation is empty
        for batch, hyps in zip(batches, pool.map(search, batches)):  # each batch's result is its own: same outputs
            for i, hyp in zip(batch.tolist(), hyps):
                outputs[i] = hyp.tokens
            bar.update(len(batch))
    return outputs
