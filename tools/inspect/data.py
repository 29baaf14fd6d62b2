"""The views of the data stages' outputs: the raw corpus (data/raw) and the batches (data/batches)."""

from __future__ import annotations

from pathlib import Path
from textwrap import indent

import numpy as np

from pipeline.core import config
from pipeline.corpus.batching import model_lengths, padding_stats
from pipeline.core.config import BatchConfig
from pipeline.core.files import count_lines
from pipeline.corpus.formats import BATCHED_SPLITS, SPLITS, Ragged, batch_paths, load_batches
from tools.inspect.common import (InspectError, Options, figure, language_pair, length_histogram,
                                  params_or_reason, save_png, scan_text, shown, sibling, spread, summary, table)

BUCKET = 10  # tokens: batches are grouped by their longest sequence in buckets this wide


def show_raw(path: Path, opts: Options) -> None:
    """Lines per split and language, aligned sample pairs, and words per line (words.png)."""
    langs = language_pair(path, sibling(path, "tokenized", opts.tokenized), opts.params)
    print(f"raw corpus {shown(path)}: {langs[0]} -> {langs[1]}\n")
    # Streamed: words per line and the sample lines only, never a whole WMT-size corpus as Python strings.
    train_lines = min(count_lines(path / f"train.{lang}") if (path / f"train.{lang}").is_file() else 0
                      for lang in langs)
    picks = spread(train_lines, opts.n)
    words, samples = {}, {}
    for split in SPLITS:
        for lang in langs:
            words[split, lang], samples[split, lang] = scan_text(
                path / f"{split}.{lang}", f"{split} text in {lang}, one sentence per line (written by the download "
                "stage)", keep=set(picks) if split == "train" else set())
    keys = [(split, [(split, lang) for lang in langs]) for split in SPLITS]
    rows = [[split, *(len(words[k]) for k in ks), *(int((words[k] == 0).sum()) for k in ks)] for split, ks in keys]
    print(table(["split", *(f"{lang} lines" for lang in langs), *(f"{lang} empty" for lang in langs)], rows))
    print("\nwords per line:")
    for split in SPLITS:
        for lang in langs:
            print(f"  {split}.{lang}: {summary(words[split, lang])}")
    print(f"\n{opts.n} sample pairs of train (spread over the file):")
    for i in picks:
        print(f"  line {i + 1}\n" + "".join(f"    {lang}: {samples['train', lang][i]}\n" for lang in langs), end="")
    fig, axes = figure(len(SPLITS))
    for ax, split in zip(axes, SPLITS):
        length_histogram(ax, [words[split, lang] for lang in langs], list(langs), f"{split}: words per line", "words")
    save_png(fig, opts.out, "words.png")
    for split in SPLITS:
        (a, na), (b, nb) = ((f"{split}.{lang}", len(words[split, lang])) for lang in langs)
        if na != nb:
            raise InspectError(f"{shown(path / a)} has {na} lines but {b} has {nb}: expected the two sides to align "
                               "line by line")


def select(batches: Ragged, chosen: np.ndarray) -> Ragged:
    """The batches where `chosen` ([num_batches] bool) holds, as batches of their own."""
    sizes = np.diff(batches.offsets)
    index = np.asarray(batches.values)[np.repeat(chosen, sizes)]
    return Ragged(index, np.concatenate([[0], np.cumsum(sizes[chosen])]).astype(np.int64))


def check_index(batches: Ragged, n_pairs: int, path: Path, split: str, tokenized: Path) -> str | None:
    """None when the batches hold every pair of the split once, else how they do not; an index outside the
    split is an error naming the file."""
    index_path = shown(batch_paths(path, split)[0])
    if len(batches.values) and (batches.values.min() < 0 or batches.values.max() >= n_pairs):
        raise InspectError(f"{index_path}: holds pair {int(batches.values.max())} but {shown(tokenized)} {split} has "
                           f"{n_pairs} pairs; expected batches of this tokenized corpus (re-run the batch stage)")
    counts = np.bincount(batches.values, minlength=n_pairs)
    missing, repeated = int((counts == 0).sum()), int((counts > 1).sum())
    if missing or repeated:
        return f"{n_pairs - missing:,} of {n_pairs:,} pairs batched ({missing:,} missing, {repeated:,} more than once)"
    return None


def per_batch(S: np.ndarray, T: np.ndarray, batches: Ragged) -> dict[str, np.ndarray]:
    """Per batch: sentences, real source and target tokens, and the longest sequence on either side."""
    starts, index = batches.offsets[:-1], np.asarray(batches.values)
    S, T = S[index], T[index]
    longest = np.maximum(np.maximum.reduceat(S, starts), np.maximum.reduceat(T, starts))
    return {"sentences": np.diff(batches.offsets), "src": np.add.reduceat(S, starts),
            "tgt": np.add.reduceat(T, starts), "longest": longest}


def bucket_rows(S: np.ndarray, T: np.ndarray, batches: Ragged, longest: np.ndarray) -> list[list]:
    """Padding efficiency of the batches in each BUCKET-token bucket of their longest sequence."""
    bucket = (longest - 1) // BUCKET
    rows = []
    for b in np.unique(bucket):
        chosen = bucket == b
        stats = padding_stats(S, T, select(batches, chosen))
        rows.append([f"{b * BUCKET + 1}-{(b + 1) * BUCKET}", int(chosen.sum()),
                     int(np.diff(batches.offsets)[chosen].sum()), stats["padding_efficiency"],
                     stats["src_padding_efficiency"], stats["tgt_padding_efficiency"]])
    return rows


def show_batches(path: Path, opts: Options) -> None:
    """Ragged per split, sentences and real tokens per batch, padding efficiency per length bucket (batches.png)."""
    tokenized = sibling(path, "tokenized", opts.tokenized)
    cfg, why = params_or_reason(lambda: config.load(opts.params, "batch", BatchConfig))
    print(f"batches {shown(path)} (lengths from {shown(tokenized)}, as the model sees them: source + EOS, "
          "target + BOS/EOS)")
    print(f"batch.max_tokens = {cfg.max_tokens} ({shown(opts.params)})" if cfg else
          f"batch.max_tokens: unknown ({why})")
    pictures, problems = {}, []
    for split in BATCHED_SPLITS:
        batches = load_batches(path, split)
        S, T = model_lengths(tokenized, split)
        coverage = check_index(batches, len(S), path, split, tokenized)
        print(f"\n{split}: {len(batches):,} batches; {coverage or f'all {len(S):,} pairs batched, each once'}")
        problems += [f"{shown(batch_paths(path, split)[0])}: {coverage}"] if coverage else []
        if not len(batches):
            continue
        stats, sizes = padding_stats(S, T, batches), per_batch(S, T, batches)
        print(f"  sentences per batch:    {summary(sizes['sentences'])}")
        print(f"  source tokens per batch: {summary(sizes['src'])} (real, with EOS)")
        print(f"  target tokens per batch: {summary(sizes['tgt'])} (real, with BOS/EOS)")
        print(f"  largest padded batch: {int((sizes['sentences'] * sizes['longest']).max()):,} tokens per side")
        print(f"  padding efficiency (real / padded tokens): {stats['padding_efficiency']:.4f} "
              f"(source {stats['src_padding_efficiency']:.4f}, target {stats['tgt_padding_efficiency']:.4f})")
        rows = bucket_rows(S, T, batches, sizes["longest"])
        print(f"  by the batch's longest sequence ({BUCKET}-token buckets):")
        print(indent(table(["longest", "batches", "sentences", "efficiency", "source", "target"], rows), "    "))
        pictures[split] = (sizes, rows)
    if "train" in pictures:
        draw_batches(*pictures["train"], opts)
    if problems:
        raise InspectError(f"{problems[0]}; expected every pair in exactly one batch (re-run the batch stage)")


def draw_batches(sizes: dict[str, np.ndarray], rows: list[list], opts: Options) -> None:
    """Real tokens and sentences per train batch, and padding efficiency per bucket, side by side."""
    fig, (tokens, sentences, buckets) = figure(3)
    tokens.hist([sizes["src"], sizes["tgt"]], bins=30, histtype="step", label=["source", "target"])
    tokens.set(title="train: real tokens per batch", xlabel="tokens", ylabel="batches")
    tokens.legend()
    sentences.hist(sizes["sentences"], bins=30)
    sentences.set(title="train: sentences per batch", xlabel="sentences", ylabel="batches")
    buckets.bar([r[0] for r in rows], [r[3] for r in rows])
    buckets.set(title="train: padding efficiency", xlabel="longest sequence in the batch (tokens)",
                ylabel="real / padded tokens", ylim=(min(r[3] for r in rows) * 0.95, 1.0))
    buckets.tick_params(axis="x", labelrotation=90)
    save_png(fig, opts.out, "batches.png")
