"""Export the averaged model to CTranslate2 and check it against the project's decoder (not in the paper).

    python -m stages.export --model data/model --tokenized data/tokenized --raw data/raw --out data/export
                            --metrics metrics/export.json [--params params.yaml]

Reads params `export` (ExportConfig) and translate's length limits (max_len_a, max_len_b). Writes
data/export/ (replaced whole, atomically, only once the check passed): CTranslate2's model.bin (weights as
export.quantization says) and vocabularies, config.json (CTranslate2's, plus a `project` entry: the source
model.pt's sha256 and params hash, its steps, the tokenizer's sha256, max_positions, the quantization and the type
CTranslate2 computes it in), spm.model, the sentencepiece model (pipeline/export/spec.py maps the weights), and
seal.sha256, every file's sha256 (pipeline/export/seal.py: each reader checks it first). A quantization that
CTranslate2 cannot compute on this machine (it would silently compute another type) is refused before anything is
written. Then both engines decode the validation split's first export.check_lines lines (0: all) greedily
(pipeline/export/check.py); metrics/export.json holds the share of identical outputs, the largest log-prob
difference, both BLEUs, both sizes and both speeds. An export with a smaller share of identical outputs than
export.min_identical gives for its quantization fails the stage and leaves the previous export in place (dvc.yaml
keeps data/export under `dvc repro` too: persist). A temporary folder or `.export.old` left by a killed run is
removed or put back by the next one (pipeline/core/files.py, atomic_dir).

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
from pipeline.core.files import InputError, atomic_dir, file_sha256, write_json
from pipeline.weights import faults

log = logging.getLogger(__name__)


def export(args, cfg: ExportConfig, translate: TranslateConfig) -> dict:
    """Write and check the export (see the module docstring); its metrics."""
    from pipeline.translation.engine import computed_type

    try:  # refused here if CTranslate2 would compute another type
        compute_type = computed_type(cfg.quantization)
    except config.ParamsError as e:
        raise config.ParamsError(f"{args.params}: {e}") from None
    import torch

    from pipeline.corpus.formats import load_split, read_meta
    from pipeline.export.check import compare
    from pipeline.translation.engine import Ctranslate2Engine, default_threads
    from pipeline.export.seal import model_digest
    from pipeline.export.spec import ExportError, write_ctranslate2
    from pipeline.translation.scoring import read_lines
    from pipeline.weights.checkpoint import load_averaged, load_model

    threads = default_threads()
    torch.set_num_threads(threads)
    log.info("export: reading %s (checked against its seal)", args.model / "model.pt")
    saved = load_averaged(args.model)
    model = load_model(args.model, torch.device("cpu"), saved)
    meta = read_meta(args.tokenized)
    sources = load_split(args.tokenized, "valid", meta["src_lang"])
    references = read_lines(args.raw / f"valid.{meta['tgt_lang']}", "download")
    if len(references) != len(sources):
        raise InputError(f"{args.raw}/valid.{meta['tgt_lang']}: {len(references)} lines but {args.tokenized} holds "
                         f"{len(sources)} valid sentences; re-run the tokenize stage")
    n = len(sources) if cfg.check_lines == 0 else min(cfg.check_lines, len(sources))
    spm_model = args.tokenized / "spm.model"
    about = {"params_hash": saved.get("params_hash"), "steps": saved.get("steps"), "model_config": saved["model_config"],
             "model_sha256": model_digest(args.model / "model.pt"), "spm_sha256": file_sha256(spm_model),
             "compute_type": compute_type}
    with atomic_dir(args.out) as tmp:
        start = time.perf_counter()
        log.info("export: writing the CTranslate2 model (%s, computed as %s)", cfg.quantization, compute_type)
        write_ctranslate2(model, args.tokenized, tmp, cfg.quantization, about)
        seconds = time.perf_counter() - start
        faults.inject("export_written", 0)  # tests only: a kill with the export written, not yet checked or moved
        engine = Ctranslate2Engine(tmp, threads, args.model / "model.pt", spm_model)
        log.info("export: written in %.1f s; both engines decode %d validation lines greedily", seconds, n)
        metrics = compare(model, engine, [sources[i] for i in range(n)], references[:n], translate)
        del engine  # its threads, before the directory moves
        threshold = getattr(cfg.min_identical, cfg.quantization)
        metrics.update(enabled=True, quantization=cfg.quantization, compute_type=compute_type, export_seconds=seconds,
                       min_identical=threshold, model_bytes_project=(args.model / "model.pt").stat().st_size,
                       model_bytes_ctranslate2=(tmp / "model.bin").stat().st_size, params_hash=about["params_hash"])
        log.info("export: %d of %d validation lines identical (%.2f%%), log-probs within %.2g; BLEU %.2f / %.2f; "
                 "%.1f / %.1f sentences/s (project / ctranslate2)", metrics["identical_lines"], n,
                 100 * metrics["identical_rate"], metrics["max_log_prob_diff"], metrics["bleu_project"],
                 metrics["bleu_ctranslate2"], metrics["sentences_per_second_project"],
                 metrics["sentences_per_second_ctranslate2"])
        if metrics["identical_rate"] < threshold:
            raise ExportError(f"{args.out}: the {compute_type} export (export.quantization = {cfg.quantization}) "
                              f"decodes {metrics['identical_lines']} of {n} validation lines as the project does, under "
                              f"export.min_identical.{cfg.quantization} = {threshold:.1%}; the previous export is kept")
        faults.inject("export_checked", 0)  # tests only: a kill just before the swap
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
