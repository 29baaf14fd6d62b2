"""Is run B better than run A? BLEU and chrF differences with sacrebleu's paired bootstrap resampling.

    python -m tools.compare A B [--split test] [--samples 1000] [--tracking-uri URI]

A and B are MLflow run ids (a pipeline run or its evaluate stage's run) or DVC
experiment names (the `dvc_exp_name` tag of a pipeline run). The hypotheses and
references come from the artifacts the evaluate stage logged with each run
(`hypotheses/<split>.<lang>`, `references/<split>.<lang>`); the two runs must
have been scored on byte-identical references, else the comparison is refused.

Prints each run's score with its 95% confidence interval (bootstrap), the
difference B - A and its p-value: the share of resamples in which the
difference is at least as large as observed, under sacrebleu's paired test
(Koehn 2004, as Moses' bootstrap-hypothesis-difference-significance.pl).
p < 0.05 is the usual bar for "B differs from A". The resampling is seeded
(sacrebleu's SACREBLEU_SEED, 12345 by default): the same runs give the same figures.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

from pipeline.core import cli, tracking
from pipeline.translation.scoring import read_pair

class CompareError(ValueError):
    """The runs cannot be compared; the message says which run and why."""


@dataclass(frozen=True)
class Scored:
    """One run's translations of a split and the references they were scored on."""

    name: str
    hypotheses: list[str]
    references: list[str]
    reference_sha256: str


def evaluate_run(client, key: str):
    """The evaluate stage's MLflow run for `key`: a run id (pipeline or evaluate run) or a DVC experiment name."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(key)
    except MlflowException:  # not a run id: the newest evaluate run of that DVC experiment
        experiments = [e.experiment_id for e in client.search_experiments()]
        found = client.search_runs(experiments, filter_string=f"tags.dvc_exp_name = '{key}' and tags.stage = 'evaluate'",
                                   order_by=["attributes.start_time DESC"], max_results=1)
        if not found:
            raise CompareError(f"{key}: no MLflow run id, and no evaluate run of a DVC experiment named {key!r}") from None
        return found[0]
    if run.data.tags.get("stage") == "evaluate":
        return run
    children = client.search_runs([run.info.experiment_id], order_by=["attributes.start_time DESC"], max_results=1,
                                  filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}' and tags.stage = 'evaluate'")
    if not children:
        raise CompareError(f"{key}: run {run.info.run_id} has no evaluate stage: it never translated and scored")
    return children[0]


def scored(client, key: str, split: str, work: Path) -> Scored:
    """Download the hypotheses and references that run `key`'s evaluate stage logged for `split`."""
    run = evaluate_run(client, key)
    paths = {}
    for kind in ("hypotheses", "references"):
        names = [a.path for a in client.list_artifacts(run.info.run_id, kind) if Path(a.path).stem == split]
        if len(names) != 1:
            raise CompareError(f"{key}: evaluate run {run.info.run_id} logged no {kind}/{split}.* artifact "
                               "(scored before evaluate kept its files?)")
        paths[kind] = Path(client.download_artifacts(run.info.run_id, names[0], str(work / run.info.run_id / kind)))
    hyps, refs = read_pair(paths["hypotheses"], paths["references"])
    return Scored(key, hyps, refs, hashlib.sha256(paths["references"].read_bytes()).hexdigest())


def compare(a: Scored, b: Scored, samples: int) -> str:
    """The report: both runs' BLEU and chrF with 95% intervals, B - A and its p-value."""
    if a.reference_sha256 != b.reference_sha256:
        raise CompareError(f"{a.name} and {b.name} were scored on different references "
                           f"(sha256 {a.reference_sha256[:12]}... vs {b.reference_sha256[:12]}...): not comparable")
    metrics = {"BLEU": BLEU(), "chrF": CHRF()}
    test = PairedTest([(a.name, a.hypotheses), (b.name, b.hypotheses)], metrics, [a.references],
                      test_type="bs", n_samples=samples)
    signatures, results = test()
    lines = [f"paired bootstrap, {samples} resamples, {len(a.references)} sentences"]
    identical = a.hypotheses == b.hypotheses
    for name in metrics:
        key = next(k for k in results if k.startswith(name))
        ra, rb = results[key]
        # sacrebleu's test centres the resampled differences, so identical systems (every difference 0) get
        # p = 1 / (samples + 1); identical hypotheses have no difference to test: p = 1.
        p_value = 1.0 if identical else rb.p_value
        verdict = "differs (p < 0.05)" if p_value < 0.05 else "no significant difference"
        lines += [f"{key}: A {ra.score:.2f} (95% CI +-{ra.ci:.2f})  B {rb.score:.2f} (95% CI +-{rb.ci:.2f})  "
                  f"B - A {rb.score - ra.score:+.2f}  p = {p_value:.4f}: {verdict}",
                  f"  signature: {signatures[key]}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--split", default="test")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--tracking-uri", default=None, help="default: pipeline.core.tracking's (mlflow.db at the repo root)")
    args = parser.parse_args(argv)
    cli.setup_logging()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(args.tracking_uri or tracking.tracking_uri())
    with tempfile.TemporaryDirectory() as work:
        try:
            runs = [scored(client, key, args.split, Path(work)) for key in (args.a, args.b)]
            print(compare(*runs, args.samples))
        except CompareError as e:
            sys.exit(f"compare: error: {e}")


if __name__ == "__main__":
    main()
