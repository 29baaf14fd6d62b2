"""The length limits both decoders share (the project's beam search and the CTranslate2 export): torch-free.

A source is cut to the positions the model has; an output may hold at most floor(max_len_a * S + max_len_b)
tokens, EOS included (at least 1), S the source's length with its EOS (model/beam_search.py, max_lengths).
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

from pipeline.core.config import TranslateConfig

log = logging.getLogger(__name__)


def max_source_len(max_positions: int, cfg: TranslateConfig) -> int:
    """Longest source (EOS included) that fits the positional encoding, and whose output limit fits too."""
    if cfg.max_len_a == 0:
        return max_positions if cfg.max_len_b <= max_positions else 0
    return min(max_positions, int((max_positions - cfg.max_len_b) // cfg.max_len_a))


def max_output_len(source_len: int, cfg: TranslateConfig) -> int:
    """Most output tokens, EOS included, for a source of `source_len` tokens (EOS included)."""
    return max(1, math.floor(cfg.max_len_a * source_len + cfg.max_len_b))


def warn_cut(sources: Sequence, limit: int) -> None:
    """Warn, once for the batch, of the sources longer than `limit` tokens, which both decoders cut to it."""
    if cut := sum(len(s) > limit for s in sources):  # Paper: no limit; ours is model.max_positions
        log.warning("%d source sentence(s) longer than %d tokens are cut to fit model.max_positions", cut, limit)
