"""Subword tokenization: one shared sentencepiece model (Sec. 5.1), trained on a seeded sample, and encoding with all cores.

Used by the tokenize stage and the tools that show its output. The model is
trained on the training text of both sides; when the corpus is larger than
`input_sentence_size` sentences, a seeded uniform sample of that many trains it
(sample_sentences), so WMT fits in memory. Deterministic: the same text, params
and seed give the same bytes (portable strips the model's record of its path and
thread count). One caveat from sentencepiece: a unigram model (not BPE) can
differ slightly between machines with different core counts, as its EM sums per
thread. Training pairs are dropped by drop_reasons: empty, longer than `max_len`
tokens, or a length ratio above `max_len_ratio`.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from pipeline.core.config import ParamsError, TokenizeConfig
from pipeline.core.files import read_chunks
from pipeline.corpus.formats import BOS_ID, EOS_ID, ID_DTYPE, PAD_ID, UNK_ID

DROP_REASONS = ("empty", "too_long", "ratio")


def num_threads() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
