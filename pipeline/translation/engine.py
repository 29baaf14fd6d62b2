"""Decoding with the export stage's CTranslate2 model, as the translate stage decodes with the project's: no torch.

    engine = Ctranslate2Engine(Path("data/export"), threads=2)
    outputs = engine.translate_ids(sources, cfg)          # output ids (no BOS/EOS) per source, input order
    lines = engine.detokenize(outputs)

The same tokenization (the export's copy of the sentencepiece model), the same source cut (pipeline/translation/lengths.py),
EOS appended to each source, the decoder starting from BOS, and an empty source line not decoded (its output is
empty). How translate's params map onto CTranslate2's search:

- beam_size: the same. beam_size 1 is greedy decoding, as the project's (identical outputs, checked by the
  export stage).
- max_len_a, max_len_b: the project allows floor(max_len_a * S + max_len_b) output tokens, EOS included, S the
  source's length with EOS; CTranslate2 takes one max_decoding_length a batch, EOS not counted. Sources are grouped
  by length, so each group gets its own exact limit: max_decoding_length = that limit - 1 (where the project forces
  EOS, CTranslate2 stops: the same tokens).
- empty outputs: min_decoding_length 0 (CTranslate2's default 1 forbids EOS first; the project allows it).
- length_penalty: the project scores log P / ((5 + |Y|) / 6)^alpha (GNMT); CTranslate2 divides by |Y|^beta. No
  beta gives GNMT's penalty at every length; both change alike (the same slope in log |Y|) where
  beta = alpha * |Y| / (5 + |Y|). Each length group takes |Y| = S, its source length: the usual output of
  Multi30k is about as long as its source. alpha 0 maps to beta 0, exactly the project's search.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np
import sentencepiece as spm

from pipeline.core.config import ParamsError, TranslateConfig
from pipeline.core.files import InputError
from pipeline.corpus.formats import EOS_ID
from pipeline.corpus.formats import detokenize
from pipeline.export.seal import verify
from pipeline.translation.lengths import max_output_len, max_source_len, warn_cut

SPM_NAME = "spm.model"  # beside model.bin (pipeline/export/spec.py writes it)


def mapped_length_penalty(alpha: float, length: int) -> float:
    """CTranslate2's beta for the project's GNMT alpha at output length `length` (see the module docstring)."""
    return alpha * length / (5 + length)


QUANTIZED_AS = {"none": "float32"}  # export.quantization -> the compute type CTranslate2 is asked for (else the same)


def computed_type(quantization: str, device: str = "cpu") -> str:
    """The compute type CTranslate2 runs export.quantization = `quantization` in on this machine's `device`; a type it
    would silently replace by another (int16 without Intel MKL, float16 or bfloat16 on most CPUs) is refused."""
    import ctranslate2

    wanted = QUANTIZED_AS.get(quantization, quantization)
    supported = sorted(ctranslate2.get_supported_compute_types(device))
    if wanted not in supported:
        raise ParamsError(f"export.quantization = {quantization!r}: CTranslate2 cannot compute {wanted} on this "
                          f"{device} and would compute another type under that name; it computes "
                          f"{', '.join(supported)} here: set export.quantization to one of them (none = float32)")
    return wanted


class Ctranslate2Engine:
    """The export's model on `threads` CPU threads (batches decoded side by side, one thread each), or a GPU; the
    export checked first (pipeline/export/seal.py): its seal, and that it was made from `model_pt` with `spm_model`
    where those are given. `compute_type`: the type CTranslate2 actually computes in (its Translator's)."""

    def __init__(self, directory: Path, threads: int, model_pt: Path | None = None, spm_model: Path | None = None):
        import ctranslate2

        self.config = verify(Path(directory), model_pt, spm_model)
        device = "cuda" if ctranslate2.get_cuda_device_count() else "cpu"
        self.translator = ctranslate2.Translator(str(directory), device=device, compute_type="default",
                                                 inter_threads=max(1, threads), intra_threads=1)
        self.compute_type = self.translator.compute_type
        self.sp = spm.SentencePieceProcessor(model_file=str(Path(directory) / SPM_NAME))
        self.pieces = [self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())]
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}
        self.max_positions = int(self.config["project"]["max_positions"])

    def _source(self, ids: np.ndarray, limit: int) -> list[str]:
        return [self.pieces[i] for i in ids[:limit].tolist()] + [self.pieces[EOS_ID]]

    def translate_ids(self, sources: Sequence[np.ndarray], cfg: TranslateConfig, beta: float | None = None
                      ) -> list[list[int]]:
        """Output ids (no BOS/EOS) for each source (ids without EOS), in input order; `beta`: CTranslate2's length
        penalty for every length instead of the mapped one (bench.decoding.export compares them)."""
        limit = max_source_len(self.max_positions, cfg) - 1  # room for EOS
        if limit < 0:
            raise InputError(f"translate.max_len_a = {cfg.max_len_a}, max_len_b = {cfg.max_len_b}: even an empty "
                             f"source's output limit exceeds the model's max_positions = {self.max_positions}")
        warn_cut(sources, limit)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, ids in enumerate(sources):
            if len(ids):
                groups[min(len(ids), limit) + 1].append(i)
        outputs: list[list[int]] = [[] for _ in sources]
        pending = []
        for length, members in sorted(groups.items(), reverse=True):
            steps = max_output_len(length, cfg) - 1  # tokens before EOS
            if steps <= 0:
                continue  # only EOS fits: the empty output
            batch = max(1, min(cfg.max_tokens // length, cfg.max_tokens // cfg.beam_size))
            results = self.translator.translate_batch(
                [self._source(sources[i], limit) for i in members], max_batch_size=batch, beam_size=cfg.beam_size,
                length_penalty=mapped_length_penalty(cfg.length_penalty, length) if beta is None else beta,
                max_decoding_length=steps,
                min_decoding_length=0, max_input_length=0, asynchronous=True)
            pending.append((members, results))
        for members, results in pending:
            for i, result in zip(members, results):
                outputs[i] = [self.ids[piece] for piece in result.result().hypotheses[0]]
        return outputs

    def log_probs(self, sources: Sequence[np.ndarray], outputs: Sequence[list[int]], cfg: TranslateConfig
                  ) -> list[np.ndarray]:
        """Each output's per-token log-probabilities (EOS's last) given its source, by CTranslate2."""
        limit = max_source_len(self.max_positions, cfg) - 1
        results = self.translator.score_batch([self._source(s, limit) for s in sources],
                                              [[self.pieces[i] for i in out] for out in outputs],
                                              max_input_length=0)
        return [np.asarray(r.log_probs, dtype=np.float64) for r in results]

    def detokenize(self, outputs: list[list[int]]) -> list[str]:
        """Sentencepiece-decode each output; one line each (the project engine's detokenize)."""
        return detokenize(self.sp, outputs)


def default_threads() -> int:
    """OMP_NUM_THREADS where set (as torch reads it), else every core."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return os.cpu_count() or 1
