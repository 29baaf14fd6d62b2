"""Translate the test and valid sets with the averaged model and beam search (Sec. 6.1).

    python -m stages.translate --model data/model --tokenized data/tokenized --raw data/raw --out data/translations [--params params.yaml]

Reads params `translate` (TranslateConfig): beam_size, length_penalty (alpha),
the output length limit max_len_a * S + max_len_b and max_tokens. Each split's
encoded source ids (data/tokenized/{split}.{src}, plus EOS) are sorted longest
first and cut into batches of at most `max_tokens` padded source tokens and
at most max_tokens // beam_size sentences (so that the decoder's beam_size rows
per sentence stay within max_tokens rows too); each batch is one batched beam
search (model/beam_search.py). Outputs go back to the original order, are
detokenized with the sentencepiece model, and written (both splits at once,
atomically) as data/translations/{split}.{tgt}: line i translates source line i.
An empty source line (or one that encodes to no pieces) is not decoded: its
translation is an empty line, in the files and on stdout. data/raw is read only to check that the encoded
splits still match it line for line.

Precision: the training precision of the device (distributed.autocast_dtype: bf16 on GPUs that have it, fp16 on
7.x, fp32 on CPUs), the weights cast to it once (decoding_precision); recorded as the MLflow param
`decode_precision` and in the log.

Interactive / piped use, same model, search and params:

    echo "A man rides a bike." | python -m stages.translate --stdin
    python -m stages.translate --stdin --model data/model --tokenized data/tokenized < sentences.en

reads raw sentences from stdin, one per line, and prints one translation per
line, flushed batch by batch: lines that arrive together (a pipe, a file) are
translated together; lines typed one at a time are answered one at a time.
Stdin is read as the corpus files are (strict UTF-8; a BOM and CRLF line ends
accepted): a line that is not UTF-8 stops the stage with an error naming it,
after the lines before it have been translated and printed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import sentencepiece as spm
import torch
from torch.nn.utils.rnn import pad_sequence
from pipeline.progress import progress_bar

from model.beam_search import Hypothesis, beam_search
from model.transformer import Transformer
from pipeline.core import cli, config, tracking
from pipeline.training import attention, distributed
from pipeline.weights.checkpoint import load_model
from pipeline.core.config import ParamsError, TranslateConfig
from pipeline.corpus.rawtext import decode_line
from pipeline.corpus.formats import BOS_ID, DECODED_SPLITS, EOS_ID, PAD_ID, load_spm, load_split, read_meta
from pipeline.core.files import InputError, atomic_dir, count_lines, write_text

log = logging.getLogger(__name__)

def max_source_len(max_positions: int, cfg: TranslateConfig) -> int:
    """Longest source (EOS included) that fits the positional encoding, and whose output limit fits too."""
    if cfg.max_len_a == 0:
        return max_positions if cfg.max_len_b <= max_positions else 0
    return min(max_positions, int((max_positions - cfg.max_len_b) // cfg.max_len_a))


def decoding_precision(model: Transformer) -> torch.dtype:
    """Cast `model` in place, once, to the precision training ran in on its device; returns that dtype.

    The whole model, as fairseq's generate does with --fp16 (model.half()), not autocast around each step:
    autocast's cast weights are cached only until its block exits, so a step under autocast casts every weight
    again. In bf16 the residual stream and LayerNorm outputs are rounded to bf16; LayerNorm and softmax still
    accumulate in fp32 inside their kernels, and beam search scores fp32 log-probabilities (_next_logits).
    A CPU decodes in fp32, as it trains: the model is left as it is.
    """
    dtype = distributed.autocast_dtype(model.embedding.weight.device)
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
    if truncated := sum(len(s) > limit for s in sources):  # Paper: no limit; ours is model.max_positions
        log.warning("%d source sentence(s) longer than %d tokens are cut to fit model.max_positions", truncated, limit)

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


def detokenize(sp: spm.SentencePieceProcessor, outputs: list[list[int]]) -> list[str]:
    """Sentencepiece-decode each output; one line each."""
    return [line.replace("\n", " ") for line in sp.decode(outputs)] if outputs else []


def translate_split(model: Transformer, sp: spm.SentencePieceProcessor, tokenized: Path, raw: Path,
                    split: str, langs: tuple[str, str], cfg: TranslateConfig) -> list[str]:
    """Translate one split's encoded source, after checking it still matches the raw file."""
    sources = load_split(tokenized, split, langs[0])
    raw_path = raw / f"{split}.{langs[0]}"
    if not raw_path.exists():
        raise InputError(f"{raw_path}: missing; run the download stage first")
    if (n := count_lines(raw_path)) != len(sources):
        raise InputError(f"{tokenized}: {split}.{langs[0]} holds {len(sources)} sentences but {raw_path} has {n} "
                         "lines; re-run the tokenize stage")
    start = time.perf_counter()
    lines = detokenize(sp, translate_ids(model, sources, cfg))
    seconds = time.perf_counter() - start
    log.info("%s: %d sentences in %.1f s (%.1f sentences/s)", split, len(lines), seconds,
             len(lines) / max(seconds, 1e-9))
    return lines


def stdin_batches(fd: int, max_lines: int) -> Iterator[list[str]]:
    """Lines from `fd` in groups: all that have arrived (up to max_lines), so typed lines come back one by one.

    Lines are read as files are (rawtext.decode_line: strict UTF-8, a BOM and "\\r\\n" accepted); a line that is
    not UTF-8 raises InputError naming it, once the lines before it have been yielded (and translated).
    """
    pending, lines, eof, n = b"", [], False, 0
    while not eof:
        chunk = os.read(fd, 1 << 16)
        eof = not chunk
        *complete, pending = (pending + chunk).split(b"\n")
        lines += complete + ([pending] if eof and pending else [])
        waiting = not eof and select.select([fd], [], [], 0)[0]
        if lines and (len(lines) >= max_lines or not waiting):
            batch, error = [], None
            for raw in lines:
                n += 1
                try:
                    batch.append(decode_line(raw, first=n == 1))
                except ValueError as e:
                    error = InputError(f"standard input, line {n}: {e}")
                    break
            if batch:
                yield batch
            if error:
                raise error
            lines = []


def translate_stdin(model: Transformer, sp: spm.SentencePieceProcessor, cfg: TranslateConfig) -> None:
    """Translate stdin line by line to stdout, flushing after every group of lines."""
    if sys.stdin.isatty():
        print("Type a sentence and press Enter (Ctrl-D to end).", file=sys.stderr, flush=True)
    for lines in stdin_batches(sys.stdin.fileno(), max(1, cfg.max_tokens // cfg.beam_size)):
        sources = [np.asarray(ids, dtype=np.int64) for ids in sp.encode(lines)]
        for line in detokenize(sp, translate_ids(model, sources, cfg, progress=False)):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/model"))
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--raw", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--stdin", action="store_true", help="translate stdin to stdout, one sentence per line")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    if not args.stdin and (args.raw is None or args.out is None):
        parser.error("--raw and --out are required unless --stdin is given")
    cli.setup_logging()
    cfg = config.load(args.params, "translate", TranslateConfig)
    if "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins
        torch.set_num_threads(os.cpu_count() or 1)
    model = load_model(args.model, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    precision = str(decoding_precision(model)).removeprefix("torch.")  # float32, bfloat16, float16
    log.info("decoding in %s", precision)
    log.info("attention: %s", attention.use(model.embedding.weight.device))  # the kernels training chose, on CUDA
    sp = load_spm(args.tokenized, model.embedding.num_embeddings)
    if args.stdin:
        translate_stdin(model, sp, cfg)
        return
    meta = read_meta(args.tokenized)
    langs = (meta["src_lang"], meta["tgt_lang"])
    with tracking.stage_run("translate", args) as run:
        run.log_params({"translate": asdict(cfg), "decode_precision": precision})
        start = time.perf_counter()
        translations = {split: translate_split(model, sp, args.tokenized, args.raw, split, langs, cfg)
                        for split in DECODED_SPLITS}
        seconds = time.perf_counter() - start
        with atomic_dir(args.out) as tmp:
            for split, lines in translations.items():
                write_text(tmp / f"{split}.{langs[1]}", "".join(line + "\n" for line in lines))
        sentences = sum(map(len, translations.values()))
        log.info("wrote %s: %d sentences, %.1f sentences/s", args.out, sentences, sentences / max(seconds, 1e-9))
        run.log_metrics({"sentences": sentences, "sentences_per_second": sentences / max(seconds, 1e-9)})


if __name__ == "__main__":
    cli.run(main)
