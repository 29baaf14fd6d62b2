"""The on-disk formats between stages: encoded splits and length-bucketed batches.

data/tokenized/ (written by stages.tokenize)
    spm.model, spm.vocab         the shared sentencepiece model (ids below)
    {split}.{lang}.ids           flat little-endian uint16 token ids, no BOS/EOS
    {split}.{lang}.offsets       little-endian int64, n + 1 entries, offsets[0] = 0
    meta.json                    vocab_size, src_lang, tgt_lang, lines per split

data/batches/ (written by stages.batch)
    {split}.index.npy            int64 example indices, grouped batch after batch
    {split}.bounds.npy           int64, num_batches + 1 entries: batch b is
                                 index[bounds[b]:bounds[b + 1]]

Everything is memory-mapped, never unpickled: no Python lists of the corpus.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from pipeline.core.files import InputError

# Special ids of the shared sentencepiece vocabulary (stages.tokenize sets them).
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPLITS = ("train", "valid", "test")
BATCHED_SPLITS = ("train", "valid")  # the batch stage's; test is batched by the translate stage
DECODED_SPLITS = ("test", "valid")  # what the translate stage translates and the evaluate stage scores
ID_DTYPE = np.dtype("<u2")
OFFSET_DTYPE = np.dtype("<i8")


@dataclass(frozen=True)
class Ragged:
    """A ragged array: row i is values[offsets[i]:offsets[i + 1]].

    An encoded split (rows: sentences, values: token ids) or a split's batches
    (rows: batches, values: example indices), as stored on disk.
    """

    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def split_paths(directory: str | Path, split: str, lang: str) -> tuple[Path, Path]:
    directory = Path(directory)
    return directory / f"{split}.{lang}.ids", directory / f"{split}.{lang}.offsets"


def load_split(directory: str | Path, split: str, lang: str) -> Ragged:
    """Memory-map one encoded split written by stages.tokenize."""
    ids_path, offsets_path = split_paths(directory, split, lang)
    for p in (ids_path, offsets_path):
        if not p.exists():
            raise InputError(f"{p}: missing; run the tokenize stage first")
    ids = np.memmap(ids_path, dtype=ID_DTYPE, mode="r") if ids_path.stat().st_size else np.zeros(0, ID_DTYPE)
    offsets = np.fromfile(offsets_path, dtype=OFFSET_DTYPE)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
        raise InputError(f"{offsets_path}: offsets do not describe {ids_path} ({len(ids)} ids)")
    return Ragged(ids, offsets)


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / "meta.json"
    if not path.exists():
        raise InputError(f"{path}: missing; run the tokenize stage first")
    return json.loads(path.read_text(encoding="utf-8"))


def load_spm(directory: str | Path, vocab_size: int) -> spm.SentencePieceProcessor:
    """The shared sentencepiece model, after checking it has the `vocab_size` pieces a model was trained with."""
    path = Path(directory) / "spm.model"
    if not path.exists():
        raise InputError(f"{path}: missing; run the tokenize stage first")
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        raise InputError(f"{path}: not a sentencepiece model ({e})") from None
    if sp.get_piece_size() != vocab_size:
        raise InputError(f"{path} has {sp.get_piece_size()} pieces but the model has a vocabulary of "
                         f"{vocab_size}: they were not trained together")
    return sp


def detokenize(sp: spm.SentencePieceProcessor, outputs: list[list[int]]) -> list[str]:
    """Sentencepiece-decode each output of a decoder (either engine): one line each."""
    return [line.replace("\n", " ") for line in sp.decode(outputs)] if outputs else []


def batch_paths(directory: str | Path, split: str) -> tuple[Path, Path]:
    directory = Path(directory)
    return directory / f"{split}.index.npy", directory / f"{split}.bounds.npy"


def load_batches(directory: str | Path, split: str) -> Ragged:
    """Memory-map the batches of one split written by stages.batch."""
    index_path, bounds_path = batch_paths(directory, split)
    for p in (index_path, bounds_path):
        if not p.exists():
            raise InputError(f"{p}: missing; run the batch stage first")
    index = np.load(index_path, mmap_mode="r", allow_pickle=False)
    bounds = np.load(bounds_path, allow_pickle=False)
    if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != len(index):
        raise InputError(f"{bounds_path}: bounds do not describe {index_path}")
    return Ragged(index, bounds)
