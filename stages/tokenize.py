"""Train one shared sentencepiece model on both languages and encode every split to token ids.

    python -m stages.tokenize --raw data/raw --out data/tokenized --metrics metrics/tokenize.json [--params params.yaml]

Reads params `data` (src_lang, tgt_lang) and `tokenize` (TokenizeConfig). One
model over the training text of both sides (Sec. 5.1: a shared source-target
vocabulary), trained from the raw files themselves; sentencepiece samples
`input_sentence_size` sentences when the corpus is larger, so WMT fits in memory.
Every split is then encoded with all cores, 100k lines at a time, and appended to
the flat files that stages/corpus.py documents: nothing ever holds a whole
corpus as Python lists. Training pairs that are empty, longer than `max_len`
tokens or whose length ratio exceeds `max_len_ratio` are dropped and counted by
reason; valid and test are never filtered (an empty line stays, as an empty
sequence), so translations stay aligned with the references.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from stages import config
from stages.config import DataConfig, ParamsError, TokenizeConfig
from stages.corpus import BOS_ID, EOS_ID, ID_DTYPE, OFFSET_DTYPE, PAD_ID, SPLITS, UNK_ID, split_paths
from stages.files import atomic_dir, write_json

log = logging.getLogger(__name__)

CHUNK_LINES = 100_000  # lines encoded at a time: bounds memory whatever the corpus size
MAX_VOCAB = int(np.iinfo(ID_DTYPE).max) + 1  # ids are stored as uint16
DROP_REASONS = ("empty", "too_long", "ratio")


class RawDataError(ValueError):
    """The raw corpus is missing, misaligned or unreadable; the message names the file."""


@dataclass(frozen=True)
class SplitStats:
    """What encoding one split produced (pairs kept, tokens per side, pairs dropped by reason)."""

    pairs: int
    src_tokens: int
    tgt_tokens: int
    unk_tokens: int
    dropped: dict[str, int]


def num_threads() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_config(cfg: TokenizeConfig, params: str | Path) -> None:
    """Reject values sentencepiece or the uint16 format cannot take, naming the key."""
    problems = []
    if not 4 < cfg.vocab_size <= MAX_VOCAB:
        problems.append(
            f"tokenize.vocab_size = {cfg.vocab_size}: must be > 4 (the special ids) and <= {MAX_VOCAB} "
            "(token ids are stored as uint16)"
        )
    if cfg.model_type not in ("bpe", "unigram"):
        problems.append(f"tokenize.model_type = {cfg.model_type!r}: expected 'bpe' or 'unigram'")
    if not 0 < cfg.character_coverage <= 1:
        problems.append(f"tokenize.character_coverage = {cfg.character_coverage}: expected a value in (0, 1]")
    if cfg.input_sentence_size < 0:
        problems.append(f"tokenize.input_sentence_size = {cfg.input_sentence_size}: expected >= 0 (0 = all)")
    if cfg.max_len < 1:
        problems.append(f"tokenize.max_len = {cfg.max_len}: expected >= 1")
    if cfg.max_len_ratio < 1:
        problems.append(f"tokenize.max_len_ratio = {cfg.max_len_ratio}: expected >= 1")
    if problems:
        raise ParamsError(f"{params}: " + "; ".join(problems))


def count_lines(path: Path) -> int:
    """Lines in a file, counting a last line without a newline."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def check_raw(raw: Path, langs: tuple[str, str]) -> dict[str, int]:
    """Lines per split, after checking that every raw file exists and both sides align."""
    missing = [str(raw / f"{s}.{lang}") for s in SPLITS for lang in langs if not (raw / f"{s}.{lang}").is_file()]
    if missing:
        raise RawDataError(f"missing raw file(s): {', '.join(missing)}; run the download stage first")
    lines = {}
    for split in SPLITS:
        (a, na), (b, nb) = ((raw / f"{split}.{lang}", count_lines(raw / f"{split}.{lang}")) for lang in langs)
        if na != nb:
            raise RawDataError(f"{a} has {na} lines but {b} has {nb}: the two sides of {split} must align line by line")
        lines[split] = na
    if lines["train"] == 0:
        raise RawDataError(f"{raw / f'train.{langs[0]}'} is empty: nothing to train the tokenizer on")
    return lines


def train_model(files: list[Path], prefix: Path, cfg: TokenizeConfig) -> spm.SentencePieceProcessor:
    """Train the shared sentencepiece model on `files`; writes prefix.model and prefix.vocab."""
    spm.set_random_generator_seed(cfg.seed)  # seeds the sentence sampling: same inputs, same model
    try:
        spm.SentencePieceTrainer.train(
            input=[str(f) for f in files],
            model_prefix=str(prefix),
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            input_sentence_size=cfg.input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=num_threads(),
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            minloglevel=1,
        )
    except RuntimeError as e:
        raise ValueError(f"sentencepiece could not train with tokenize.vocab_size = {cfg.vocab_size}: {e}") from None
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def read_chunks(path: Path, chunk_lines: int = CHUNK_LINES) -> Iterator[list[str]]:
    """Yield the lines of a UTF-8 file, without newlines, `chunk_lines` at a time."""
    with open(path, "rb") as f:
        first = 1
        while chunk := list(itertools.islice(f, chunk_lines)):
            try:
                yield [line.rstrip(b"\n").decode("utf-8") for line in chunk]
            except UnicodeDecodeError as e:
                bad = next(i for i, line in enumerate(chunk) if not _is_utf8(line))
                raise RawDataError(f"{path}:{first + bad}: not valid UTF-8 ({e.reason})") from None
            first += len(chunk)


def _is_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def encode(sp: spm.SentencePieceProcessor, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode lines with all cores; returns (flat uint16 ids, int64 lengths)."""
    pieces = sp.encode(lines, out_type=int, num_threads=num_threads())
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=ID_DTYPE, count=int(lengths.sum()))
    return ids, lengths


def drop_reasons(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, max_len_ratio: float) -> np.ndarray:
    """Per pair: 0 = keep, else 1 + the index in DROP_REASONS of the first reason that applies."""
    shorter, longer = np.minimum(src_len, tgt_len), np.maximum(src_len, tgt_len)
    return np.select(
        [shorter == 0, longer > max_len, longer > max_len_ratio * shorter],
        [1, 2, 3],
        default=0,
    )


class SideWriter:
    """Appends encoded sentences to one {split}.{lang}.ids/.offsets pair."""

    def __init__(self, ids_file: BinaryIO, offsets_file: BinaryIO):
        self.ids_file, self.offsets_file, self.total = ids_file, offsets_file, 0
        np.zeros(1, OFFSET_DTYPE).tofile(offsets_file)

    def append(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        ids.astype(ID_DTYPE, copy=False).tofile(self.ids_file)
        (self.total + np.cumsum(lengths, dtype=OFFSET_DTYPE)).astype(OFFSET_DTYPE).tofile(self.offsets_file)
        self.total += int(lengths.sum())


def encode_split(
    sp: spm.SentencePieceProcessor,
    raw: Path,
    out: Path,
    split: str,
    langs: tuple[str, str],
    lines: int,
    cfg: TokenizeConfig | None,
) -> SplitStats:
    """Encode both sides of one split into `out`; filters pairs by `cfg` unless it is None."""
    (src_ids_path, src_off_path), (tgt_ids_path, tgt_off_path) = (split_paths(out, split, lang) for lang in langs)
    dropped = np.zeros(len(DROP_REASONS) + 1, dtype=np.int64)
    unk = 0
    with (
        open(src_ids_path, "wb") as si,
        open(src_off_path, "wb") as so,
        open(tgt_ids_path, "wb") as ti,
        open(tgt_off_path, "wb") as to,
        tqdm(total=lines, unit="line", desc=f"encode {split}", unit_scale=True, mininterval=5) as bar,
    ):
        src_writer, tgt_writer = SideWriter(si, so), SideWriter(ti, to)
        chunks = zip(read_chunks(raw / f"{split}.{langs[0]}"), read_chunks(raw / f"{split}.{langs[1]}"))
        for src_lines, tgt_lines in chunks:
            (src_ids, src_len), (tgt_ids, tgt_len) = encode(sp, src_lines), encode(sp, tgt_lines)
            if cfg is not None:
                reason = drop_reasons(src_len, tgt_len, cfg.max_len, cfg.max_len_ratio)
                dropped += np.bincount(reason, minlength=len(dropped))
                keep = reason == 0
                src_ids, tgt_ids = src_ids[np.repeat(keep, src_len)], tgt_ids[np.repeat(keep, tgt_len)]
                src_len, tgt_len = src_len[keep], tgt_len[keep]
            src_writer.append(src_ids, src_len)
            tgt_writer.append(tgt_ids, tgt_len)
            unk += int(np.count_nonzero(src_ids == UNK_ID) + np.count_nonzero(tgt_ids == UNK_ID))
            bar.update(len(src_lines))
    kept = (src_off_path.stat().st_size // OFFSET_DTYPE.itemsize) - 1
    return SplitStats(kept, src_writer.total, tgt_writer.total, unk, dict(zip(DROP_REASONS, dropped[1:].tolist())))


def tokenize(raw: Path, out: Path, langs: tuple[str, str], cfg: TokenizeConfig) -> dict:
    """Train the shared model, encode every split into `out` (atomically) and return flat metrics."""
    lines = check_raw(raw, langs)
    log.info("lines per split: %s", lines)
    metrics: dict = {}
    with atomic_dir(out) as tmp:
        start = time.perf_counter()
        log.info("training sentencepiece %s, vocab %d, on train.%s + train.%s", cfg.model_type, cfg.vocab_size, *langs)
        sp = train_model([raw / f"train.{lang}" for lang in langs], tmp / "spm", cfg)
        log.info("trained in %.0f s", time.perf_counter() - start)
        metrics["vocab_size"] = sp.get_piece_size()
        kept = {}
        for split in SPLITS:
            stats = encode_split(sp, raw, tmp, split, langs, lines[split], cfg if split == "train" else None)
            if split == "train":
                if stats.pairs == 0:
                    raise RawDataError(
                        f"{raw}/train.{{{','.join(langs)}}}: every one of the {lines['train']} training pairs was dropped "
                        f"({', '.join(f'{v} {k}' for k, v in stats.dropped.items())}); "
                        "check tokenize.max_len and tokenize.max_len_ratio"
                    )
                metrics.update({f"dropped_{k}": v for k, v in stats.dropped.items()})
                metrics["train_pairs_raw"] = lines["train"]
            metrics.update({f"{split}_pairs": stats.pairs, f"{split}_src_tokens": stats.src_tokens,
                            f"{split}_tgt_tokens": stats.tgt_tokens,
                            f"{split}_unk_rate": stats.unk_tokens / max(stats.src_tokens + stats.tgt_tokens, 1)})
            kept[split] = stats.pairs
        write_json(tmp / "meta.json", {"vocab_size": metrics["vocab_size"], "src_lang": langs[0],
                                       "tgt_lang": langs[1], "lines": kept})
    log.info("wrote %s: %s", out, kept)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    data = config.load(args.params, "data", DataConfig)
    cfg = config.load(args.params, "tokenize", TokenizeConfig)
    check_config(cfg, args.params)
    metrics = tokenize(args.raw, args.out, (data.src_lang, data.tgt_lang), cfg)
    write_json(args.metrics, metrics)


if __name__ == "__main__":
    main()
