"""Score the translations: sacreBLEU and chrF, plus the paper's tokenized BLEU.

    python -m stages.evaluate --translations data/translations --raw data/raw --metrics metrics/eval.json
        [--train-metrics metrics/train.json] [--params params.yaml]

Reads params `evaluate` (EvaluateConfig) and `data.tgt_lang`. For the test and
valid splits, data/translations/{split}.{tgt} (detokenized hypotheses) is
scored against the raw references data/raw/{split}.{tgt}: `bleu` and `chrf`
(sacreBLEU on detokenized text, tokenizer `evaluate.tokenize`, mixed case: the
numbers to compare across papers) and `bleu_tokenized` (the paper's number,
tensor2tensor's get_ende_bleu.sh); on Multi30k (`data.name` multi30k) also
`bleu_lc_norm_tok`, the multimodal-MT papers' BLEU on the dataset's
lowercased, normalised, Moses-tokenized text (not sacreBLEU: a figure to set
beside those papers'). pipeline/translation/scoring.py says how each is computed.

metrics/eval.json is flat: the test set under plain keys (bleu, chrf,
bleu_tokenized, [bleu_lc_norm_tok,] signature, chrf_signature), the dev set
as valid_bleu, valid_chrf, valid_bleu_tokenized[, valid_bleu_lc_norm_tok], each as sacreBLEU prints it (2 decimals:
100.0 when hypothesis and reference agree, not 100.00000000000004). The last
line on stdout is `BLEU = xx.x (sacreBLEU signature: ...)`, after the
Multi30k line `Multi30k lc.norm.tok BLEU = xx.xx (...)` where it applies. A hypothesis file
that is empty or whose line count differs from its reference is an error, and
no metrics are written.

With --train-metrics (dvc.yaml passes the train stage's metrics/train.json) the
scores say how the model's training ended: `stopped_by` (max_steps, or
max_minutes when the wall-clock safety stop train.max_minutes fired first) and
`train_steps` go into eval.json, and so into MLflow's tags and metrics. A run
the safety stop cut short is not the recipe's result: the stage says so in a
line on stdout before the BLEU line (so `make run` ends with it) and on the
MLflow run (tag `stopped_by`); the scores are still written, of the model that
was trained. A train.json without a valid `stopped_by` or `steps` fails in one
line. The MLflow run keeps the hypotheses and references scored
(artifacts `hypotheses/` and `references/`), for `python -m tools.compare`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from pipeline.core import cli, config, tracking
from pipeline.core.config import DataConfig, EvaluateConfig
from pipeline.core.errors import PipelineError
from pipeline.core.files import InputError, write_json
from pipeline.corpus.formats import DECODED_SPLITS
from pipeline.translation.scoring import multi30k_bleu, read_pair, score

log = logging.getLogger(__name__)

MULTI30K = "multi30k"  # data.name of the corpus whose papers report bleu_lc_norm_tok
STOPS = ("max_steps", "max_minutes")  # metrics/train.json's stopped_by: how the train stage can end
LC_NORM_TOK = "lowercased, punctuation normalised, Moses-tokenized as Multi30k's task1-tokenize.sh; not sacreBLEU"


def metrics_prefix(split: str) -> str:
    """Metrics keys of the test split are bare (`bleu`), the others carry the split (`valid_bleu`)."""
    return "" if split == "test" else f"{split}_"


def score_splits(translations: Path, raw: Path, lang: str, tokenize: str, multi30k: bool = False) -> dict:
    """Flat metrics for every decoded split (with `multi30k`, bleu_lc_norm_tok too); nothing is returned unless
    every split could be read."""
    pairs = {split: read_pair(translations / f"{split}.{lang}", raw / f"{split}.{lang}") for split in DECODED_SPLITS}
    metrics: dict = {}
    for split in DECODED_SPLITS:
        prefix = metrics_prefix(split)
        s = score(*pairs[split], lang, tokenize)
        log.info("%s: BLEU %.2f, chrF %.2f, tokenized BLEU %.2f (%d sentences)",
                 split, s.bleu, s.chrf, s.bleu_tokenized, len(pairs[split][0]))
        metrics.update({f"{prefix}bleu": s.bleu, f"{prefix}chrf": s.chrf, f"{prefix}bleu_tokenized": s.bleu_tokenized})
        if multi30k:
            metrics[f"{prefix}bleu_lc_norm_tok"] = multi30k_bleu(*pairs[split], lang)
            log.info("%s: Multi30k lc.norm.tok BLEU %.2f (%s)", split, metrics[f"{prefix}bleu_lc_norm_tok"], LC_NORM_TOK)
        if not prefix:
            metrics.update(signature=s.signature, chrf_signature=s.chrf_signature)
    return metrics


def training_end(path: Path) -> dict:
    """`stopped_by` and `train_steps` of the train stage's metrics/train.json at `path` (PipelineError when they
    are missing or not what the train stage writes)."""
    mend = "re-run the train stage (`dvc repro train`)"
    if not path.is_file():
        raise InputError(f"{path}: missing; run the train stage first")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"{path}: not the train stage's JSON metrics ({e}); {mend}") from None
    stopped_by = record.get("stopped_by") if isinstance(record, dict) else None
    steps = record.get("steps") if isinstance(record, dict) else None
    if stopped_by not in STOPS or not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise PipelineError(f"{path}: expected stopped_by (one of {', '.join(STOPS)}) and steps (a whole number) "
                            f"as the train stage writes them, got stopped_by {stopped_by!r}, steps {steps!r}; {mend}")
    return {"stopped_by": stopped_by, "train_steps": steps}


def cut_short_line(end: dict) -> str:
    """What the stage prints when the safety stop ended training before train.max_steps."""
    return (f"Not the recipe's result: training stopped by the safety stop train.max_minutes at step "
            f"{end['train_steps']}, before train.max_steps (metrics/eval.json: stopped_by = max_minutes); "
            f"`dvc exp run -S train.max_minutes=0` resumes it to train.max_steps")


def main(argv: list[str] | None = None) -> None:
    parser = cli.stage_parser(__doc__, "translations", "raw", "metrics")
    parser.add_argument("--train-metrics", type=Path, help="the train stage's metrics/train.json: how training ended")
    args = parser.parse_args(argv)
    cli.setup_logging()
    cfg = config.load(args.params, "evaluate", EvaluateConfig)
    data = config.load(args.params, "data", DataConfig)
    lang, multi30k = data.tgt_lang, data.name == MULTI30K
    with tracking.stage_run("evaluate", args) as run:
        run.log_params({"evaluate": asdict(cfg), "data": {"tgt_lang": lang, "name": data.name}})
        metrics = score_splits(args.translations, args.raw, lang, cfg.tokenize, multi30k)
        end = training_end(args.train_metrics) if args.train_metrics else {}  # after the translations are found
        metrics |= end
        if end:
            run.set_tags({"stopped_by": end["stopped_by"]})
        for split in DECODED_SPLITS:  # what tools.compare tests for significance, with the reference it was scored on
            run.log_artifact(args.translations / f"{split}.{lang}", "hypotheses")
            run.log_artifact(args.raw / f"{split}.{lang}", "references")
        write_json(args.metrics, metrics)
        run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, float)})
    if end.get("stopped_by") == "max_minutes":
        log.warning("%s", cut_short_line(end))
        print(cut_short_line(end), flush=True)
    if multi30k:
        print(f"Multi30k lc.norm.tok BLEU = {metrics['bleu_lc_norm_tok']:.2f} ({LC_NORM_TOK})", flush=True)
    print(f"BLEU = {metrics['bleu']:.1f} (sacreBLEU signature: {metrics['signature']})", flush=True)


if __name__ == "__main__":
    cli.run(main)
