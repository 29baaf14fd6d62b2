"""The view of the tokenize stage's output (data/tokenized): vocabulary, pieces, lengths, round trip, drops."""

from __future__ import annotations

import logging
from pathlib import Path
from textwrap import indent

import numpy as np
import sentencepiece as spm

from pipeline.core.files import count_lines
from pipeline.corpus.formats import ID_DTYPE, SPLITS, UNK_ID, Ragged, load_spm, load_split, read_meta, split_paths
from pipeline.corpus.subwords import DROP_REASONS, encode
from tools.inspect.common import (InspectError, Options, figure, length_histogram, read_json, save_png, shown,
                                  scan_lines, sibling, spread, summary, table)

log = logging.getLogger(__name__)

TOP_PIECES = 15
ROUND_TRIP_PAIRS = 100_000  # raw pairs re-encoded per split at most: the first ones (WMT train holds millions)
CHUNK_IDS = 1 << 24  # token ids read and counted at a time (piece_counts)


def piece_counts(directory: Path, split: str, lang: str, vocab_size: int) -> np.ndarray:
    """How often each id occurs in one stored side, read CHUNK_IDS ids at a time (not memory-mapped: WMT's
    gigabytes of ids never count against this process's memory); at least vocab_size entries."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    with open(split_paths(directory, split, lang)[0], "rb") as f:
        while len(chunk := np.fromfile(f, dtype=ID_DTYPE, count=CHUNK_IDS)):
            found = np.bincount(chunk, minlength=len(counts))
            found[: len(counts)] += counts
            counts = found
    return counts


def check_split(split: str, pair: list[Ragged], counts: list[np.ndarray], vocab_size: int, directory: Path,
                langs: tuple[str, str]) -> None:
    """Both sides hold as many sentences, and only ids of the vocabulary; else the files are corrupt."""
    if len(pair[0]) != len(pair[1]):
        raise InspectError(f"{shown(directory)}: {split}.{langs[0]} holds {len(pair[0])} sentences but "
                           f"{split}.{langs[1]} {len(pair[1])}; expected aligned pairs")
    for side_counts, lang in zip(counts, langs):
        if side_counts[vocab_size:].any():
            raise InspectError(f"{shown(split_paths(directory, split, lang)[0])}: holds id "
                               f"{int(np.flatnonzero(side_counts)[-1])}; expected ids below the vocabulary size "
                               f"{vocab_size}")


def sentence_keys(ids: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """Each sentence's ids as bytes: equal sentences, equal keys."""
    ids, ends = np.asarray(ids), np.cumsum(lengths)
    return [ids[end - n : end].tobytes() for end, n in zip(ends.tolist(), lengths.tolist())]


def align(stored: list[tuple], fresh: list[tuple], whole: bool = True) -> np.ndarray:
    """For each raw pair (re-encoded), the stored pair it became, or -1 if it was dropped; in order. `whole`:
    both hold the whole split (else the first raw pairs and as many first stored ones)."""
    if whole and len(stored) == len(fresh):  # valid and test are never filtered: line by line
        return np.arange(len(fresh))
    where, i = np.full(len(fresh), -1), 0
    for j, pair in enumerate(fresh):
        if i < len(stored) and stored[i] == pair:
            where[j], i = i, i + 1
    return where


def first_pairs(side: Ragged, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The flat ids and lengths of the first n sentences of a stored side."""
    offsets = np.asarray(side.offsets[: n + 1])
    return np.asarray(side.values[: offsets[-1]]), np.diff(offsets)


def round_trip(sp: spm.SentencePieceProcessor, raw: Path, sides: dict, split: str, langs: tuple[str, str],
               limit: int) -> None:
    """Print whether the stored ids of `split` are its raw text re-encoded, and which lines do not decode back;
    a split of more than `limit` raw pairs is checked on its first `limit` (and says so)."""
    paths = [raw / f"{split}.{lang}" for lang in langs]
    total = count_lines(paths[0]) if paths[0].is_file() else 0
    lines = [scan_lines(path, f"the raw {split} text the ids were made from", limit) for path in paths]
    whole = total <= limit
    log.info("re-encoding %s/%s.* (%s) and decoding the stored ids", shown(raw), split,
             "all" if whole else f"the first {limit:,} of {total:,} pairs")
    encoded = [encode(sp, side) for side in lines]  # (flat ids, lengths) per language
    stored = list(zip(*(sentence_keys(*first_pairs(sides[split, lang], limit)) for lang in langs)))
    fresh = list(zip(*(sentence_keys(ids, lengths) for ids, lengths in encoded)))
    where = align(stored, fresh, whole)
    kept = np.flatnonzero(where >= 0).tolist()
    if whole:
        stale = sum(stored[where[j]] != fresh[j] for j in kept) + len(stored) - len(kept)
        counted = f"{len(fresh):,} raw pairs, {len(stored):,} stored"
    else:  # the stored pairs up to the last one matched belong to these raw pairs; any unmatched among them is stale
        reached = int(where.max()) + 1 if kept else len(stored)
        stale = reached - len(kept)
        counted = f"the first {len(fresh):,} of {total:,} raw pairs (at most {limit:,} a split are re-encoded), {reached:,} stored"
    print(f"  {split}: {counted}; {len(fresh) - len(kept):,} not stored; "
          + (f"{stale:,} stored pairs differ from the raw text re-encoded (stale? re-run the tokenize stage)" if stale
             else "every stored pair equals the raw text re-encoded"))
    if len(kept) < len(fresh):
        j = int(np.flatnonzero(where < 0)[0])
        print(f"    first pair not stored (dropped), line {j + 1}: "
              + " | ".join(f"{lang} ({encoded[k][1][j]} pieces) {lines[k][j]!r}" for k, lang in enumerate(langs)))
    for k, lang in enumerate(langs):
        decoded = sp.decode([sides[split, lang][where[j]].tolist() for j in kept])
        changed = [(j, text) for j, text in zip(kept, decoded) if text != lines[k][j]]
        print(f"    {lang}: {len(changed):,} of {len(kept):,} lines do not decode back to the raw line", end="")
        for j, text in changed[:1]:
            print(f"; e.g. line {j + 1}: raw {lines[k][j]!r} -> {text!r}", end="")
        print()


def show_drops(path: Path) -> None:
    """Dropped training pairs by reason, from metrics/tokenize.json beside data/ if it is there."""
    metrics_path = path.absolute().parent.parent / "metrics" / "tokenize.json"
    if not metrics_path.is_file():
        print(f"\ndropped training pairs by reason: unknown (no {shown(metrics_path)})")
        return
    metrics = read_json(metrics_path, "the tokenize stage's metrics")
    reasons = ", ".join(f"{reason} {metrics.get(f'dropped_{reason}', '?')}" for reason in DROP_REASONS)
    print(f"\ndropped training pairs ({shown(metrics_path)}): "
          f"{metrics.get('train_pairs_raw', 0) - metrics.get('train_pairs', 0):,} of "
          f"{metrics.get('train_pairs_raw', 0):,} ({reasons})")


def show_tokenized(path: Path, opts: Options) -> None:
    """Vocabulary and frequent pieces, samples as pieces, tokens per sentence (tokens.png), round trip, drops."""
    meta = read_meta(path)
    if not all(key in meta for key in ("vocab_size", "src_lang", "tgt_lang")):
        raise InspectError(f"{shown(path / 'meta.json')}: expected the keys vocab_size, src_lang, tgt_lang; "
                           f"found {sorted(meta)}")
    sp, langs = load_spm(path, meta["vocab_size"]), (meta["src_lang"], meta["tgt_lang"])
    sides = {(split, lang): load_split(path, split, lang) for split in SPLITS for lang in langs}
    counts = {(split, lang): piece_counts(path, split, lang, sp.get_piece_size()) for split in SPLITS for lang in langs}
    for split in SPLITS:
        check_split(split, [sides[split, lang] for lang in langs], [counts[split, lang] for lang in langs],
                    sp.get_piece_size(), path, langs)
    print(f"tokenized corpus {shown(path)}: {langs[0]} -> {langs[1]}, shared vocabulary of {sp.get_piece_size():,} "
          "pieces\n")
    rows = [[split, len(sides[split, langs[0]]), *(int(sides[split, lang].lengths.sum()) for lang in langs)]
            for split in SPLITS]
    print(table(["split", "pairs", *(f"{lang} tokens" for lang in langs)], rows))
    print("\ntokens per sentence (no BOS/EOS):")
    for split in SPLITS:
        for lang in langs:
            print(f"  {split}.{lang}: {summary(sides[split, lang].lengths)}")
    show_pieces(sp, [sides["train", lang] for lang in langs], counts["train", langs[0]] + counts["train", langs[1]],
                langs, opts.n)
    show_drops(path)
    raw = sibling(path, "raw", opts.raw)
    if raw.is_dir():
        print(f"\nround trip against {shown(raw)} (sentencepiece normalises text, e.g. NFKC and repeated spaces, so "
              "some lines legitimately do not decode back):")
        for split in SPLITS:
            round_trip(sp, raw, sides, split, langs, ROUND_TRIP_PAIRS)
    else:
        print(f"\nround trip: skipped (no raw corpus at {shown(raw)}; give --raw DIR)")
    fig, axes = figure(1)
    length_histogram(axes[0], [sides["train", lang].lengths for lang in langs], list(langs),
                     "train: tokens per sentence", "pieces")
    save_png(fig, opts.out, "tokens.png")


def show_pieces(sp: spm.SentencePieceProcessor, train: list[Ragged], counts: np.ndarray, langs: tuple[str, str],
                n: int) -> None:
    """The most frequent pieces of the training ids (both sides: `counts`), and sample sentences as pieces and text."""
    total = int(counts.sum())
    top = np.argsort(-counts, kind="stable")[:TOP_PIECES]
    print(f"\nmost frequent pieces in train (both sides, {total:,} tokens; {int((counts == 0).sum()):,} pieces never "
          f"used; unknown {int(counts[UNK_ID]):,}):")
    rows = [[int(i), sp.id_to_piece(int(i)), int(counts[i]), f"{counts[i] / max(total, 1):.2%}"] for i in top]
    print(indent(table(["id", "piece", "count", "share"], rows), "  "))
    print(f"\n{n} sample train pairs, as pieces and decoded back:")
    for i in spread(len(train[0]), n):
        print(f"  pair {i + 1}")
        for lang, side in zip(langs, train):
            ids = side[i].tolist()
            print(f"    {lang} pieces: {' '.join(sp.id_to_piece(t) for t in ids)}\n    {lang} text:   {sp.decode(ids)}")
