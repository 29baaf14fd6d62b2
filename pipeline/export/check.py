"""The export checked against the project's decoder: both decode the same sources greedily.

    metrics = compare(model, engine, sources, references, cfg)

Greedy (beam 1, no length penalty) with translate's length limits, MAX_TOKENS source tokens a batch, both engines on every CPU thread: the share of
identical outputs, the largest difference between the two engines' log-probabilities of the project's output
tokens (EOS included, teacher-forced), sacreBLEU of each against the references, and each engine's sentences/s.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch
from sacrebleu.metrics import BLEU
from torch.nn.utils.rnn import pad_sequence

from model.transformer import Transformer
from pipeline.core.config import TranslateConfig
from pipeline.corpus.formats import BOS_ID, EOS_ID, PAD_ID
from pipeline.translation.decoding import translate_ids
from pipeline.translation.engine import Ctranslate2Engine
from pipeline.translation.lengths import max_source_len

MAX_TOKENS = 4000  # source tokens a batch, both engines (the default's translate.max_tokens; not read from params, so
                   # that a change of translate.max_tokens does not re-run the export)


def project_log_probs(model: Transformer, sources: Sequence[np.ndarray], outputs: Sequence[list[int]],
                      cfg: TranslateConfig, rows: int = 64) -> list[np.ndarray]:
    """Each output's per-token log-probabilities (EOS's last) given its source, by the project's model."""
    limit = max_source_len(model.max_positions, cfg) - 1
    out = []
    with torch.inference_mode():
        for start in range(0, len(sources), rows):
            src = [torch.tensor([*s[:limit].tolist(), EOS_ID]) for s in sources[start : start + rows]]
            gold = [torch.tensor([*o, EOS_ID]) for o in outputs[start : start + rows]]
            tgt_in = [torch.tensor([BOS_ID, *o]) for o in outputs[start : start + rows]]
            logits = model(pad_sequence(src, True, PAD_ID), pad_sequence(tgt_in, True, PAD_ID)).float()
            lp = torch.log_softmax(logits, dim=-1).gather(2, pad_sequence(gold, True, PAD_ID)[:, :, None])[:, :, 0]
            out += [lp[i, : len(g)].double().numpy() for i, g in enumerate(gold)]
    return out


def _timed(decode) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outputs = decode()
    return outputs, time.perf_counter() - start


def compare(model: Transformer, engine: Ctranslate2Engine, sources: Sequence[np.ndarray], references: list[str],
            cfg: TranslateConfig) -> dict:
    """Greedy outputs of both engines on `sources` (ids without EOS) scored against `references` (metrics above)."""
    greedy = replace(cfg, beam_size=1, length_penalty=0.0, max_tokens=MAX_TOKENS)
    ours, ours_s = _timed(lambda: translate_ids(model, sources, greedy, progress=False))
    theirs, theirs_s = _timed(lambda: engine.translate_ids(sources, greedy))
    decoded = [i for i, s in enumerate(sources) if len(s)]
    diff = 0.0
    if decoded:
        a = project_log_probs(model, [sources[i] for i in decoded], [ours[i] for i in decoded], greedy)
        b = engine.log_probs([sources[i] for i in decoded], [ours[i] for i in decoded], greedy)
        diff = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    bleu = BLEU()
    n = len(sources)
    identical = sum(x == y for x, y in zip(ours, theirs))
    return {
        "lines": n,
        "identical_lines": identical,
        "identical_rate": identical / max(n, 1),
        "max_log_prob_diff": diff,
        "bleu_project": round(bleu.corpus_score(engine.detokenize(ours), [references]).score, 2),
        "bleu_ctranslate2": round(bleu.corpus_score(engine.detokenize(theirs), [references]).score, 2),
        "sentences_per_second_project": n / max(ours_s, 1e-9),
        "sentences_per_second_ctranslate2": n / max(theirs_s, 1e-9),
    }
