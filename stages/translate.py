"""Translate the test and valid sets with the averaged model and beam search (Sec. 6.1).

    python -m stages.translate --model data/model --tokenized data/tokenized --export data/export --raw data/raw
                               --out data/translations [--engine project|ctranslate2] [--params params.yaml]

Reads params `translate` (TranslateConfig): beam_size, length_penalty (alpha),
the output length limit max_len_a * S + max_len_b and max_tokens. Each split's
encoded source ids (data/tokenized/{split}.{src}, plus EOS) are sorted longest
first and cut into batches of at most `max_tokens` padded source tokens and
at most max_tokens // beam_size sentences (so that the decoder's beam_size rows
per sentence stay within max_tokens rows too); each batch is one batched beam
search (model/beam_search.py; pipeline/translation/decoding.py). Outputs go back to the original order, are
detokenized with the sentencepiece model, and written (both splits at once,
atomically) as data/translations/{split}.{tgt}: line i translates source line i.
An empty source line (or one that encodes to no pieces) is not decoded: its
translation is an empty line, in the files and on stdout. data/raw is read only to check that the encoded
splits still match it line for line.

Precision: translate.precision, auto = fp32 on every device (bf16 weights decoded slower than fp32 on the GPU
measured; pipeline/translation/decoding.py), or fp32 / bf16 / fp16 forced, the weights cast to it once (decoding_precision);
recorded as the MLflow param `decode_precision` and in the log.

Engine: translate.engine (or --engine) ctranslate2 decodes with the export stage's CTranslate2 model (data/export)
instead, with the same tokenization, source cut, beam size and length limits, and the length penalty mapped
(pipeline/translation/engine.py says how); that path never imports torch. The export is checked first
(pipeline/export/seal.py): every file against its seal, and that it was made from --model's model.pt and with
--tokenized's tokenizer; translate.precision is the project engine's, refused with this one (the export computes in
export.quantization's type, recorded as decode_precision). The project engine checks model.pt against its seal.

Interactive / piped use, same model, search and params:

    echo "A man rides a bike." | python -m stages.translate --stdin
    echo "A man rides a bike." | python -m stages.translate --stdin --engine ctranslate2
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
import logging
import os
import select
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import sentencepiece as spm

from pipeline.core import checks, cli, config, tracking
from pipeline.core.config import TranslateConfig
from pipeline.corpus.rawtext import decode_line
from pipeline.corpus.formats import detokenize
from pipeline.corpus.formats import DECODED_SPLITS, load_spm, load_split, read_meta
from pipeline.core.files import InputError, atomic_dir, count_lines, write_text

log = logging.getLogger(__name__)

Decode = Callable[[list[np.ndarray], bool], list[list[int]]]  # (sources, progress bar) -> output ids per source


def translate_split(decode: Decode, sp: spm.SentencePieceProcessor, tokenized: Path, raw: Path,
                    split: str, langs: tuple[str, str]) -> list[str]:
    """Translate one split's encoded source, after checking it still matches the raw file."""
    sources = load_split(tokenized, split, langs[0])
    raw_path = raw / f"{split}.{langs[0]}"
    if not raw_path.exists():
        raise InputError(f"{raw_path}: missing; run the download stage first")
    if (n := count_lines(raw_path)) != len(sources):
        raise InputError(f"{tokenized}: {split}.{langs[0]} holds {len(sources)} sentences but {raw_path} has {n} "
                         "lines; re-run the tokenize stage")
    start = time.perf_counter()
    lines = detokenize(sp, decode(list(sources), True))
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


def translate_stdin(decode: Decode, sp: spm.SentencePieceProcessor, cfg: TranslateConfig) -> None:
    """Translate stdin line by line to stdout, flushing after every group of lines."""
    if sys.stdin.isatty():
        print("Type a sentence and press Enter (Ctrl-D to end).", file=sys.stderr, flush=True)
    for lines in stdin_batches(sys.stdin.fileno(), max(1, cfg.max_tokens // cfg.beam_size)):
        sources = [np.asarray(ids, dtype=np.int64) for ids in sp.encode(lines)]
        for line in detokenize(sp, decode(sources, False)):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


def project_decoder(args: argparse.Namespace, cfg: TranslateConfig) -> tuple[Decode, spm.SentencePieceProcessor, str]:
    """The project's beam search on the averaged model (data/model): (decode, sentencepiece, precision)."""
    import torch

    from pipeline.translation import decoding
    from pipeline.device import attention
    from pipeline.weights.checkpoint import load_model

    if "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins
        torch.set_num_threads(os.cpu_count() or 1)
    model = load_model(args.model, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    precision = str(decoding.decoding_precision(model, cfg.precision)).removeprefix("torch.")  # float32, bfloat16...
    log.info("decoding in %s", precision)
    log.info("attention: %s", attention.use(model.embedding.weight.device))  # the kernels training chose, on CUDA
    sp = load_spm(args.tokenized, model.embedding.num_embeddings)
    return (lambda sources, progress: decoding.translate_ids(model, sources, cfg, progress=progress)), sp, precision


def ctranslate2_decoder(args: argparse.Namespace, cfg: TranslateConfig
                        ) -> tuple[Decode, spm.SentencePieceProcessor, str]:
    """The export stage's CTranslate2 model (data/export), without torch: (decode, sentencepiece, precision)."""
    from pipeline.translation.engine import Ctranslate2Engine, default_threads

    # checked first: the export's seal, and that it is the export of --model with --tokenized's tokenizer
    engine = Ctranslate2Engine(args.export, default_threads(), args.model / "model.pt", args.tokenized / "spm.model")
    precision = f"ctranslate2 {engine.compute_type}"  # the type CTranslate2 computes in here, not the one asked for
    if engine.compute_type != (asked := engine.config["project"].get("compute_type", engine.compute_type)):
        log.warning("%s was exported to compute in %s; CTranslate2 computes it in %s on this machine", args.export,
                    asked, engine.compute_type)
    log.info("decoding with %s (%s)", args.export, precision)
    return (lambda sources, progress: engine.translate_ids(sources, cfg)), engine.sp, precision


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/model"),
                        help="the average stage's model: decoded by the project engine; with --engine ctranslate2, "
                             "the model the export must have been made from (checked)")
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--export", type=Path, default=Path("data/export"),
                        help="the export stage's model, decoded by --engine ctranslate2 (the project engine does not "
                             "read it)")
    parser.add_argument("--raw", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--stdin", action="store_true", help="translate stdin to stdout, one sentence per line")
    parser.add_argument("--engine", choices=("project", "ctranslate2"), help="the decoder (default: translate.engine)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    if not args.stdin and (args.raw is None or args.out is None):
        parser.error("--raw and --out are required unless --stdin is given")
    cli.setup_logging()
    cfg = config.load(args.params, "translate", TranslateConfig)
    cfg = replace(cfg, engine=args.engine or cfg.engine)
    try:
        checks.translate_engine(cfg)  # --engine ctranslate2 with translate.precision set
    except config.ParamsError as e:
        raise config.ParamsError(f"{args.params} with --engine {cfg.engine}: {e}") from None
    decode, sp, precision = (ctranslate2_decoder if cfg.engine == "ctranslate2" else project_decoder)(args, cfg)
    if args.stdin:
        translate_stdin(decode, sp, cfg)
        return
    meta = read_meta(args.tokenized)
    if sp.get_piece_size() != meta["vocab_size"]:
        raise InputError(f"{args.export}: its model has {sp.get_piece_size()} pieces but {args.tokenized} has "
                         f"{meta['vocab_size']}; re-run the export stage")
    langs = (meta["src_lang"], meta["tgt_lang"])
    with tracking.stage_run("translate", args) as run:
        run.log_params({"translate": asdict(cfg), "decode_precision": precision})
        start = time.perf_counter()
        translations = {split: translate_split(decode, sp, args.tokenized, args.raw, split, langs)
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
