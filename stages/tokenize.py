"""Train one shared sentencepiece model on both languages and encode every split to token ids.

    python -m stages.tokenize --raw data/raw --out data/tokenized --metrics metrics/tokenize.json [--params params.yaml]

Reads params `data` (src_lang, tgt_lang) and `tokenize` (TokenizeConfig). One
model over the training text of both sides (Sec. 5.1: a shared source-target
vocabulary; training, sampling and determinism: pipeline/corpus/subwords.py), streamed
from the raw files. Every split is then encoded with all cores, 100k lines at a
time, and appended to the flat files that pipeline/corpus/formats.py documents: nothing
ever holds a whole corpus as Python lists. Training pairs that are empty, longer
than `max_len` tokens or whose length ratio exceeds `max_len_ratio` are dropped
and counted by reason; valid and test are never filtered (an empty line stays,
as an empty sequence), so translations stay aligned with the references.

metrics/tokenize.json: vocab_size; {split}_pairs (train: kept), train_pairs_raw;
dropped_empty, dropped_too_long, dropped_ratio (train pairs, first reason that
applies); {split}_src_tokens, {split}_tgt_tokens (no BOS/EOS); {split}_unk_rate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import sentencepiece as spm
from pipeline.progress import progress_bar

from pipeline.core import cli, config, tracking
from pipeline.core.config import DataConfig, TokenizeConfig
from pipeline.core.files import InputError, atomic_dir, count_lines, read_chunks, write_json
from pipeline.corpus.formats import OFFSET_DTYPE, SPLITS, UNK_ID, split_paths
from pipeline.corpus.subwords import DROP_REASONS, drop_reasons, encode, train_model

log = logging.getLogger(__name__)


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
        with progress_bar(total=lines, unit="pair", unit_scale=True, desc=f"encode {split}", mininterval=5) as bar:
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
