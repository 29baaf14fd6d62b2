"""Train one shared sentencepiece model on both languages and encode every split to token ids.

    python -m stages.tokenize --raw data/raw --out data/tokenized --metrics metrics/tokenize.json [--params params.yaml]

Reads params `data` (src_lang, tgt_lang) and `tokenize` (TokenizeConfig). One
model over the training text of both sides (Sec. 5.1: a shared source-target
vocabulary), streamed from the raw files; when the corpus is larger than
`input_sentence_size` sentences, a seeded uniform sample of that many trains it,
so WMT fits in memory. Every split is then encoded with all cores, 100k lines at a time, and appended to
the flat files that pipeline/formats.py documents: nothing ever holds a whole
corpus as Python lists. Training pairs that are empty, longer than `max_len`
tokens or whose length ratio exceeds `max_len_ratio` are dropped and counted by
reason; valid and test are never filtered (an empty line stays, as an empty
sequence), so translations stay aligned with the references.

Deterministic: the same raw text, params and seed give the same bytes (the
model's record of its path and thread count is stripped). One caveat from
sentencepiece: a unigram model (not BPE) can differ slightly between machines
with different core counts, as its EM sums per thread.

metrics/tokenize.json: vocab_size; {split}_pairs (train: kept), train_pairs_raw;
dropped_empty, dropped_too_long, dropped_ratio (train pairs, first reason that
applies); {split}_src_tokens, {split}_tgt_tokens (no BOS/EOS); {split}_unk_rate.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
from tqdm import tqdm

from pipeline import cli, config, tracking
from pipeline.config import DataConfig, ParamsError, TokenizeConfig
from pipeline.formats import BOS_ID, EOS_ID, ID_DTYPE, OFFSET_DTYPE, PAD_ID, SPLITS, UNK_ID, split_paths
from pipeline.files import InputError, atomic_dir, count_lines, write_json

log = logging.getLogger(__name__)

CHUNK_LINES = 100_000  # lines encoded at a time: bounds memory whatever the corpus size
DROP_REASONS = ("empty", "too_long", "ratio")


def num_threads() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_raw(raw: Path, langs: tuple[str, str]) -> dict[str, int]:
    """Lines per split, after checking that every raw file exists and both sides align."""
    missing = [str(raw / f"{s}.{lang}") for s in SPLITS for lang in langs if not (raw / f"{s}.{lang}").is_file()]
    if missing:
        raise InputError(f"missing raw file(s): {', '.join(missing)}; run the download stage first")
    lines = {}
    for split in SPLITS:
        (a, na), (b, nb) = ((raw / f"{split}.{lang}", count_lines(raw / f"{split}.{lang}")) for lang in langs)
        if na != nb:
            raise InputError(f"{a} has {na} lines but {b} has {nb}: the two sides of {split} must align line by line")
        lines[split] = na
    if lines["train"] == 0:
        raise InputError(f"{raw / f'train.{langs[0]}'} is empty: nothing to train the tokenizer on")
    return lines


def sample_sentences(files: list[Path], lines: int, size: int, seed: int) -> Iterator[str]:
    """Stream `size` lines drawn uniformly, without replacement, from `files` of `lines` lines each (0 = all)."""
    total = lines * len(files)
    chosen = np.ones(total, dtype=bool)
    if 0 < size < total:
        chosen[:] = False
        chosen[np.random.default_rng(seed).choice(total, size, replace=False)] = True
    for k, path in enumerate(files):
        start = k * lines
        for chunk in read_chunks(path):
            yield from itertools.compress(chunk, chosen[start : start + len(chunk)])
            start += len(chunk)


def train_model(files: list[Path], lines: int, prefix: Path, cfg: TokenizeConfig) -> spm.SentencePieceProcessor:
    """Train the shared sentencepiece model on `files`; writes prefix.model and prefix.vocab."""
    # We sample, seeded, rather than sentencepiece: its own sampling (input_sentence_size) gave four
    # different models in four runs on 300k of 1M sentences, spm.set_random_generator_seed or not.
    sentences = sample_sentences(files, lines, cfg.input_sentence_size, cfg.seed)
    try:
        # Paper: BPE (en-de) and word pieces (en-fr) from its authors' tools; here sentencepiece on raw text.
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_prefix=str(prefix),
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            num_threads=num_threads(),
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            minloglevel=1,
        )
    except RuntimeError as e:
        raise ParamsError(f"sentencepiece failed with tokenize.vocab_size = {cfg.vocab_size}: {e}") from None
    model = Path(f"{prefix}.model")
    model.write_bytes(portable(model.read_bytes()))
    return spm.SentencePieceProcessor(model_file=str(model))


def portable(model: bytes) -> bytes:
    """The model without the path and thread count it records: equal inputs, equal bytes, on any machine."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(model)
    proto.trainer_spec.model_prefix = Path(proto.trainer_spec.model_prefix).name
    proto.trainer_spec.ClearField("num_threads")
    return proto.SerializeToString(deterministic=True)


def read_chunks(path: Path, chunk_lines: int = CHUNK_LINES) -> Iterator[list[str]]:
    """Yield the lines of a UTF-8 file (checked by count_lines), without newlines, `chunk_lines` at a time."""
    with open(path, "rb") as f:
        while chunk := list(itertools.islice(f, chunk_lines)):
            yield [line.rstrip(b"\n").decode("utf-8") for line in chunk]


def encode(sp: spm.SentencePieceProcessor, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode lines with all cores; returns (flat uint16 ids, int64 lengths)."""
    pieces = sp.encode(lines, out_type=int, num_threads=num_threads())
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=ID_DTYPE, count=int(lengths.sum()))
    return ids, lengths


def drop_reasons(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, max_len_ratio: float) -> np.ndarray:
    """Per pair: 0 = keep, else 1 + the index in DROP_REASONS of the first reason that applies.

    # Paper: no training filter is described (conf/config.yaml says why these two).
    """
    shorter, longer = np.minimum(src_len, tgt_len), np.maximum(src_len, tgt_len)
    return np.select([shorter == 0, longer > max_len, longer > max_len_ratio * shorter], [1, 2, 3], default=0)


class SideWriter:
    """Appends encoded sentences to one side of a split: {split}.{lang}.ids and .offsets."""

    def __init__(self, out: Path, split: str, lang: str):
        ids_path, offsets_path = split_paths(out, split, lang)
        self.ids_file, self.offsets_file = open(ids_path, "wb"), open(offsets_path, "wb")
        self.sentences, self.tokens, self.unk = 0, 0, 0
        # file.write, not ndarray.tofile: tofile ignores a failing fclose, so a full disk would go unnoticed
        self.offsets_file.write(np.zeros(1, OFFSET_DTYPE).tobytes())

    def append(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        self.ids_file.write(ids.tobytes())
        self.offsets_file.write((self.tokens + np.cumsum(lengths, dtype=OFFSET_DTYPE)).tobytes())
        self.sentences, self.tokens = self.sentences + len(lengths), self.tokens + len(ids)
        self.unk += int(np.count_nonzero(ids == UNK_ID))

    def close(self) -> None:
        self.ids_file.close()
        self.offsets_file.close()


def encode_split(
    sp: spm.SentencePieceProcessor, raw: Path, out: Path, split: str, langs: tuple[str, str], lines: int,
    cfg: TokenizeConfig | None,
) -> tuple[SideWriter, SideWriter, dict[str, int]]:
    """Encode both sides of one split into `out`, dropping pairs by `cfg` unless it is None.

    Returns the two closed writers (sentences, tokens, unknown tokens) and the pairs dropped by reason.
    """
    writers = [SideWriter(out, split, lang) for lang in langs]
    dropped = np.zeros(len(DROP_REASONS) + 1, dtype=np.int64)
    try:
        chunks = zip(*(read_chunks(raw / f"{split}.{lang}") for lang in langs))
        with tqdm(total=lines, unit="pair", unit_scale=True, desc=f"encode {split}", mininterval=5) as bar:
            for src_lines, tgt_lines in chunks:
                (src_ids, src_len), (tgt_ids, tgt_len) = encode(sp, src_lines), encode(sp, tgt_lines)
                if cfg is not None:
                    reason = drop_reasons(src_len, tgt_len, cfg.max_len, cfg.max_len_ratio)
                    dropped += np.bincount(reason, minlength=len(dropped))
                    keep = reason == 0
                    src_ids, tgt_ids = src_ids[np.repeat(keep, src_len)], tgt_ids[np.repeat(keep, tgt_len)]
                    src_len, tgt_len = src_len[keep], tgt_len[keep]
                writers[0].append(src_ids, src_len)
                writers[1].append(tgt_ids, tgt_len)
                bar.update(len(src_lines))
    finally:
        for w in writers:
            w.close()
    return writers[0], writers[1], dict(zip(DROP_REASONS, dropped[1:].tolist()))


def tokenize(
    raw: Path, out: Path, langs: tuple[str, str], cfg: TokenizeConfig, metrics_path: Path | None = None
) -> dict:
    """Train the shared model, encode every split into `out` (atomically) and return flat metrics.

    `metrics_path` is written before `out` is swapped in: a failure there leaves the old `out`.
    """
    lines = check_raw(raw, langs)
    log.info("lines per split: %s", lines)
    with atomic_dir(out) as tmp:
        start = time.perf_counter()
        log.info("training sentencepiece %s, vocab %d, on train.%s + train.%s", cfg.model_type, cfg.vocab_size, *langs)
        sp = train_model([raw / f"train.{lang}" for lang in langs], lines["train"], tmp / "spm", cfg)
        log.info("trained in %.0f s", time.perf_counter() - start)
        metrics: dict = {"vocab_size": sp.get_piece_size(), "train_pairs_raw": lines["train"]}
        for split in SPLITS:
            filter_by = cfg if split == "train" else None  # valid and test stay aligned with their references
            src, tgt, dropped = encode_split(sp, raw, tmp, split, langs, lines[split], filter_by)
            if split == "train":
                metrics |= {f"dropped_{reason}": n for reason, n in dropped.items()}
                if src.sentences == 0:
                    raise InputError(
                        f"{raw / f'train.{langs[0]}'}, {raw / f'train.{langs[1]}'}: all {lines['train']} training "
                        f"pairs were dropped ({', '.join(f'{n} {reason}' for reason, n in dropped.items())}); "
                        "check tokenize.max_len and tokenize.max_len_ratio"
                    )
            metrics |= {
                f"{split}_pairs": src.sentences,
                f"{split}_src_tokens": src.tokens,
                f"{split}_tgt_tokens": tgt.tokens,
                f"{split}_unk_rate": (src.unk + tgt.unk) / max(src.tokens + tgt.tokens, 1),
            }
        kept = {split: metrics[f"{split}_pairs"] for split in SPLITS}
        meta = {"vocab_size": metrics["vocab_size"], "src_lang": langs[0], "tgt_lang": langs[1], "lines": kept}
        write_json(tmp / "meta.json", meta)
        if metrics_path is not None:
            write_json(metrics_path, metrics)
    log.info("wrote %s: %s pairs", out, kept)
    return metrics


def main(argv: list[str] | None = None) -> None:
    args = cli.start(__doc__, argv, "raw", "out", "metrics")
    data = config.load(args.params, "data", DataConfig)
    cfg = config.load(args.params, "tokenize", TokenizeConfig)
    with tracking.stage_run("tokenize", args) as run:
        run.log_params({"tokenize": asdict(cfg), "data": {"src_lang": data.src_lang, "tgt_lang": data.tgt_lang}})
        run.log_results(tokenize(args.raw, args.out, (data.src_lang, data.tgt_lang), cfg, args.metrics))


if __name__ == "__main__":
    cli.run(main)
