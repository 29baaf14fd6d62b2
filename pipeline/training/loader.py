"""From stored batches to tensors: what one training or validation step reads.

    data = TrainingData.load(tokenized, batches)      # memory-mapped splits and batches (pipeline.corpus.formats)
    batch = collate(data.train_src, data.train_tgt, rows, device)
    prefetch = Prefetcher(build, device); value = prefetch.get(key, next_key)   # build(next_key) in the background

A Batch frames each pair as the model sees it: encoder input source + [EOS],
decoder input [BOS] + target, labels target + [EOS], right-padded with PAD_ID.
Batches for a GPU are copied from pinned memory without blocking the host.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipeline.training import plan

from pipeline.corpus.batching import padded
from pipeline.corpus.formats import BOS_ID, EOS_ID, PAD_ID, Ragged, load_batches, load_split, read_meta


@dataclass(frozen=True)
class Batch:
    """One padded batch: encoder input src + [EOS], decoder input [BOS] + tgt, labels tgt + [EOS]."""

    src: Tensor  # [B, S]
    tgt_in: Tensor  # [B, T]
    labels: Tensor  # [B, T], PAD_ID where there is no target token
    tokens: int  # real target tokens: labels != PAD_ID


def pad_rows(split: Ragged, rows: np.ndarray, bos: bool, eos: bool, bucket_step: float = 1.0) -> np.ndarray:
    """Sentences `rows` of `split` as one int64 [B, L] array, optionally framed by BOS/EOS, right-padded to the
    longest (with BOS/EOS) rounded up to the batch stage's length grid (batching.padded; exact at step 1)."""
    starts = split.offsets[rows]
    lengths = split.offsets[rows + 1] - starts
    longest = int(lengths.max())
    width = int(padded(np.array([longest + bos + eos]), bucket_step)[0])
    out = np.full((len(rows), width), PAD_ID, dtype=np.int64)
    cols = np.arange(longest)
    real = cols < lengths[:, None]  # [B, longest]
    out[:, int(bos) : int(bos) + longest][real] = split.values[(starts[:, None] + cols)[real]]
    if bos:
        out[:, 0] = BOS_ID
    if eos:
        out[np.arange(len(rows)), lengths + int(bos)] = EOS_ID
    return out


def collate(src: Ragged, tgt: Ragged, rows: np.ndarray, device: torch.device, bucket_step: float = 1.0) -> Batch:
    """Tensors of the sentence pairs `rows`, on `device`, each side padded to its length bucket."""
    rows = np.asarray(rows, dtype=np.int64)
    arrays = (pad_rows(src, rows, False, True, bucket_step), pad_rows(tgt, rows, True, False, bucket_step),
              pad_rows(tgt, rows, False, True, bucket_step))
    tokens = int((tgt.offsets[rows + 1] - tgt.offsets[rows]).sum()) + len(rows)
    pin = device.type == "cuda"  # page-locked host memory: the copy runs without the host waiting for it
    tensors = (torch.from_numpy(a) for a in arrays)
    src_t, tgt_in, labels = ((t.pin_memory() if pin else t).to(device, non_blocking=True) for t in tensors)
    return Batch(src_t, tgt_in, labels, tokens)


class Prefetcher:
    """Builds the next step's input in a background thread while the current step trains.

    get(key, next_key) returns build(key), already built if the previous call
    named it as its next_key, and starts building next_key. `build` must depend
    on its key alone, so prefetching never changes what is trained (exact
    resumes stay exact); its errors are raised by the get() that needs its value.
    """

    def __init__(self, build: Callable[[Hashable], object], device: torch.device):
        self.build = build
        # The thread's copies go to `device` (its current CUDA device is device 0 otherwise: a stray context there).
        init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch", initializer=init)
        self.pending: tuple[Hashable, Future] | None = None

    def get(self, key: Hashable, next_key: Hashable) -> object:
        if self.pending is not None and self.pending[0] == key:
            value = self.pending[1].result()
        else:
            value = self.build(key)
        self.pending = (next_key, self.pool.submit(self.build, next_key))
        return value


@dataclass(frozen=True)
class TrainingData:
    """The train and valid splits and their stored batches."""

    vocab_size: int
    train_src: Ragged
    train_tgt: Ragged
    valid_src: Ragged
    valid_tgt: Ragged
    train_batches: Ragged
    valid_batches: Ragged
    bucket_step: float = 1.0  # batch.length_bucket_step: each side padded to its length bucket

    @staticmethod
    def load(tokenized: Path, batches: Path, bucket_step: float = 1.0) -> TrainingData:
        meta = read_meta(tokenized)
        s, t = meta["src_lang"], meta["tgt_lang"]
        return TrainingData(int(meta["vocab_size"]), load_split(tokenized, "train", s), load_split(tokenized, "train", t),
                            load_split(tokenized, "valid", s), load_split(tokenized, "valid", t),
                            load_batches(batches, "train"), load_batches(batches, "valid"), bucket_step)

    def valid_fits(self, max_positions: int) -> np.ndarray:
        """Per valid pair: whether both sides, with EOS / BOS, fit the model's positions."""
        return np.maximum(np.diff(self.valid_src.offsets), np.diff(self.valid_tgt.offsets)) + 1 <= max_positions

    def lengths(self, batch_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Model lengths (source + EOS, target + BOS/EOS) of every pair in train batches `batch_ids`."""
        rows = np.concatenate([self.train_batches[b] for b in batch_ids]) if len(batch_ids) else np.zeros(0, np.int64)
        lengths = [split.offsets[rows + 1] - split.offsets[rows] + 1 for split in (self.train_src, self.train_tgt)]
        return lengths[0], lengths[1]

    def padded_tokens(self, rows: np.ndarray) -> int:
        """Padded tokens of the larger side of train pairs `rows` as one batch (what batch.max_tokens caps)."""
        # Only the rows' own offsets: a step's work does not grow with the split (measured by the retired
        # bench.data.loader_host: git checkout f0118e0 && python -m bench.data.loader_host; docs/benchmarks.md).
        sides = (self.train_src, self.train_tgt)
        longest = [int((side.offsets[rows + 1] - side.offsets[rows]).max()) + 1 for side in sides]
        return len(rows) * int(padded(np.array(longest), self.bucket_step).max())

    def collate_train(self, rows: np.ndarray, device: torch.device) -> Batch:
        return collate(self.train_src, self.train_tgt, rows, device, self.bucket_step)

    def micro_batches(self, mine: Sequence[tuple[int, int]], n_micro: int, spare: int, device: torch.device,
                      parts: int = 1, budget: int = 0) -> list[tuple[Batch, bool]]:
        """This rank's pieces (batch, part) of a step as (micro-batch, real): each piece's rows (every parts-th of its
        batch) in chunks of at most `budget` padded tokens (plan.split_rows; 0 = whole); topped up to n_micro
        pieces with zero-weight repeats (epoch tail, or a part left empty by a batch of fewer rows than parts)."""
        micro, pieces = [], 0
        for b, p in mine:
            rows = self.train_batches[b][p::parts]
            if len(rows):
                micro += [(self.collate_train(chunk, device), True)
                          for chunk in plan.split_rows(rows, self.padded_tokens(rows), budget)]
                pieces += 1
        if pieces < n_micro:
            rows = self.train_batches[spare][::parts]
            filler = micro[0][0] if micro else self.collate_train(
                plan.split_rows(rows, self.padded_tokens(rows), budget)[0], device)
            micro += [(filler, False)] * (n_micro - pieces)
        return micro

    def valid_share(self, rank: int, world: int, max_positions: int, device: torch.device) -> tuple[list[Batch], int]:
        """This rank's validation batches (every world-th), pairs longer than max_positions left out; (batches, left out)."""
        # Paper: every dev pair counts; ours leaves out those longer than model.max_positions (none in newstest2013).
        fits = self.valid_fits(max_positions)  # valid is never length-filtered (stages.tokenize)
        mine = (self.valid_batches[b] for b in range(rank, len(self.valid_batches), world))
        batches = [collate(self.valid_src, self.valid_tgt, rows[fits[rows]], device, self.bucket_step)
                   for rows in mine if fits[rows].any()]
        return batches, int((~fits).sum())
