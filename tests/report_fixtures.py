"""Pipeline runs as MLflow records them, and the tracking URI left as found: what the report tests share."""

from __future__ import annotations

import mlflow
import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

@pytest.fixture(autouse=True)
def no_global_tracking_uri():
    """report.main sets mlflow's process-wide tracking URI (it is a command); unset it after each test."""
    yield
    mlflow.set_tracking_uri(None)

def log_pipeline_run(client: MlflowClient, name: str, warmup_steps: int, bleu: float, bleu_tokenized: float,
                     hours: float, trained: bool = True, seed: int = 1, commit: str = "0123456789abcdef",
                     stopped_by: str = "max_steps", **more_metrics: float) -> None:
    """A pipeline run as pipeline.core.tracking records one: a tagged parent with the metrics files, a child per stage.

    more_metrics: other metrics of the parent, `train_valid_ppl=5.1` for train.valid_ppl."""
    experiment = client.get_experiment_by_name("transformer-multi30k")
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("transformer-multi30k")
    tags = {"pipeline_key": f"key-{name}", "git_commit": commit, "preset": "multi30k_small",
            "params_hash": f"hash-{name}", "data_name": "multi30k", "dvc_exp_name": name,
            "train.device": "cpu (2 threads/process)", "train.stopped_by": stopped_by,
            "eval.signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"}
    if trained:
        tags["train.params_hash"] = f"{name:0<8}-weights"
    parent = client.create_run(experiment_id, tags=tags, run_name=name).info.run_id
    metrics = {"train.flops_analytic": 1.1e15 * hours, "train.flops_paper_estimate": 2.4e15 * hours,
               "train.train_hours": hours, "train.devices": 1, "train.peak_flops": 1.0e12, "train.mfu": 0.31,
               "eval.bleu": bleu, "eval.bleu_tokenized": bleu_tokenized, "eval.chrf": 55.0}
    metrics |= {key.replace("_", ".", 1): value for key, value in more_metrics.items()}
    client.log_batch(parent, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
    stages = {"batch": {"batch.seed": seed, "train.seed": seed},
              "train": {"model.d_model": 256, "train.warmup_steps": warmup_steps, "train.seed": seed,
                        "params_hash": f"h-{name}", "device": "cpu"},
              "translate": {"translate.beam_size": 4}}
    for stage, params in stages.items():
        child = client.create_run(experiment_id, tags={"mlflow.parentRunId": parent, "stage": stage},
                                  run_name=stage).info.run_id
        client.log_batch(child, params=[Param(k, str(v)) for k, v in params.items()])
        client.set_terminated(child)
    client.set_terminated(parent)
