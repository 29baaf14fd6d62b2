"""Export the averaged model to CTranslate2 and check it against the project's decoder (not in the paper).

    python -m stages.export --model data/model --tokenized data/tokenized --raw data/raw --out data/export
                            --metrics metrics/export.json [--params params.yaml]

Reads params `export` (ExportConfig) and translate's length limits (max_len_a, max_len_b). Writes
data/export/ (replaced whole, atomically, only once the check passed): CTranslate2's model.bin (weights as
export.quantization says) and vocabularies, config.json (CTranslate2's, plus a `project` entry: the source run's
params hash and steps, max_positions, the quantization) and spm.model, the sentencepiece model
(pipeline/export/spec.py maps the weights). Then both engines decode the validation split's first
export.check_lines lines (0: all) greedily (pipeline/export/check.py); metrics/export.json holds the share of
identical outputs, the largest log-prob difference, both BLEUs, both sizes and both speeds. A float32 export
(quantization none) with under 99.5% identical outputs fails the stage and leaves the previous export in place.

export.enabled false: data/export holds only disabled.json, metrics/export.json says so; neither torch nor
CTranslate2 is imported.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.core import cli, config, tracking
from pipeline.core.config import ExportConfig, TranslateConfig
from pipeline.core.files import InputError, atomic_dir, write_json

log = logging.getLogger(__name__)


def export(args, cfg: ExportConfig, translate: TranslateConfig) -> dict:
    """Write and check the export (see the module docstring); its metrics."""
    import torch

    from pipeline.corpus.formats import load_split, read_meta
    from pipeline.export.check import MIN_IDENTICAL_FP32, compare
    from pipeline.export.engine import Ctranslate2Engine, default_threads
    from pipeline.export.spec import ExportError, write_ctranslate2
    from pipeline.translation.scoring import read_lines
    from pipeline.weights.checkpoint import load_checkpoint, load_model

    threads = default_threads()
    torch.set_num_threads(threads)
    model = load_model(args.model, torch.device("cpu"))
    saved = load_checkpoint(args.model / "model.pt")
    meta = read_meta(args.tokenized)
    sources = load_split(args.tokenized, "valid", meta["src_lang"])
    references = read_lines(args.raw / f"valid.{meta['tgt_lang']}", "download")
    if len(references) != len(sources):
        raise InputError(f"{args.raw}/valid.{meta['tgt_lang']}: {len(references)} lines but {args.tokenized} holds "
                         f"{len(sources)} valid sentences; re-run the tokenize stage")
    n = len(sources) if cfg.check_lines == 0 else min(cfg.check_lines, len(sources))
    about = {"params_hash": saved.get("params_hash"), "steps": saved.get("steps"),
             "model_config": saved["model_config"]}
    with atomic_dir(args.out) as tmp:
        start = time.perf_counter()
        write_ctranslate2(model, args.tokenized, tmp, cfg.quantization, about)
        seconds = time.perf_counter() - start
        engine = Ctranslate2Engine(tmp, threads)
        metrics = compare(model, engine, [sources[i] for i in range(n)], references[:n], translate)
        del engine  # its threads, before the directory moves
        metrics.update(enabled=True, quantization=cfg.quantization, export_seconds=seconds,
                       model_bytes_project=(args.model / "model.pt").stat().st_size,
                       model_bytes_ctranslate2=(tmp / "model.bin").stat().st_size, params_hash=about["params_hash"])
        log.info("export: %d of %d validation lines identical (%.2f%%), log-probs within %.2g; BLEU %.2f / %.2f; "
                 "%.1f / %.1f sentences/s (project / ctranslate2)", metrics["identical_lines"], n,
                 100 * metrics["identical_rate"], metrics["max_log_prob_diff"], metrics["bleu_project"],
                 metrics["bleu_ctranslate2"], metrics["sentences_per_second_project"],
                 metrics["sentences_per_second_ctranslate2"])
        if cfg.quantization == "none" and metrics["identical_rate"] < MIN_IDENTICAL_FP32:
            raise ExportError(f"{args.out}: the float32 export decodes {metrics['identical_lines']} of {n} validation "
                              f"lines as the project does, under {MIN_IDENTICAL_FP32:.1%}; the previous export is kept")
    return metrics


def main(argv: list[str] | None = None) -> None:
    args = cli.start(__doc__, argv, "model", "tokenized", "raw", "out", "metrics")
    cfg = config.load(args.params, "export", ExportConfig)
    translate = config.load(args.params, "translate", TranslateConfig)
    with tracking.stage_run("export", args) as run:
        run.log_params({"export": asdict(cfg)})
        if not cfg.enabled:
            with atomic_dir(args.out) as tmp:
                write_json(tmp / "disabled.json", {"enabled": False, "why": "export.enabled is false in params"})
            write_json(args.metrics, {"enabled": False})
            log.info("export.enabled is false: wrote %s/disabled.json only", args.out)
            return
        metrics = export(args, cfg, translate)
        write_json(args.metrics, metrics)
        run.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})


if __name__ == "__main__":
    cli.run(main)
