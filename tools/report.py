"""Compare the pipeline runs recorded in MLflow with each other and with the paper's Table 2.

    python -m tools.report [--out reports/] [--tracking-uri sqlite:///mlflow.db]

Not a DVC stage: it reads every pipeline run in the MLflow store (the tracking
URI of pipeline.tracking unless given) and writes

    reports/report.md            one row per run: preset, the params that differ
                                 between runs, the model scored, BLEU both ways,
                                 training FLOPs three ways, hours, devices; then
                                 the paper's rows
    reports/bleu_vs_flops.png    BLEU against training FLOPs (log x), ours and the paper's

Where the numbers live (pipeline/tracking.py): a pipeline run is a parent run
tagged `pipeline_key` (and preset, git_commit, dvc_exp_name); its metrics are
the DVC metrics files as `<file stem>.<key>` (eval.bleu, train.flops_analytic...),
their strings as tags (train.device, eval.signature); the params are on its
child runs, one per stage, under their params.yaml names (model.d_model...).
Only a pipeline run's own records are there (pipeline/lineage.py); runs by hand
(tag hand_run) are not pipeline runs and are left out. The `model` column is the
trained weights' params_hash (train.params_hash: model, train params, data); a
row shows BLEU and chrF only beside the model they came from.

Training FLOPs three ways:
    counted      train.flops_analytic: the model's matmul FLOPs x 3 over every token trained on
    paper's way  train.flops_paper_estimate: hours x devices x sustained fp32 TFLOPS (Sec. 6.1)
    at peak      hours x devices x the device's peak (bf16 on GPUs): what the time could have bought
"""

from __future__ import annotations

import argparse
import io
import logging
import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from pipeline import cli, tracking
from pipeline.files import write_bytes, write_text

log = logging.getLogger(__name__)

# Vaswani et al. 2017, Table 2: (system, language pair, BLEU, training cost in FLOPs).
PAPER_TABLE2 = [
    ("Transformer (base model)", "EN-DE", 27.3, 3.3e18),
    ("Transformer (big)", "EN-DE", 28.4, 2.3e19),
    ("Transformer (base model)", "EN-FR", 38.1, 3.3e18),
    ("Transformer (big)", "EN-FR", 41.0, 2.3e19),
]
HIDDEN_PARAMS = {"params.params_hash", "params.device"}  # always differ, or shown in their own column
MODEL = "tags.train.params_hash"  # the checkpoints' params_hash, from metrics/train.json
SCORES = ("BLEU (sacreBLEU)", "BLEU (tokenized, as the paper)", "chrF")  # shown only beside their MODEL
COLUMNS = {  # report column -> (parent run column, format)
    "BLEU (sacreBLEU)": ("metrics.eval.bleu", "{:.2f}"),
    "BLEU (tokenized, as the paper)": ("metrics.eval.bleu_tokenized", "{:.2f}"),
    "chrF": ("metrics.eval.chrf", "{:.1f}"),
    "hours": ("metrics.train.train_hours", "{:.2f}"),
    "FLOPs counted": ("metrics.train.flops_analytic", "{:.2e}"),
    "FLOPs paper's way": ("metrics.train.flops_paper_estimate", "{:.2e}"),
    "FLOPs at peak": ("flops_at_peak", "{:.2e}"),
    "MFU": ("metrics.train.mfu", "{:.1%}"),
}


def column(runs: pd.DataFrame, name: str) -> pd.Series:
    """A column of `runs`, or NaN everywhere when no run has it."""
    return runs[name] if name in runs else pd.Series(float("nan"), index=runs.index, dtype=object)


def load_runs(uri: str) -> pd.DataFrame:
    """One row per pipeline run (oldest first): the parent's tags and metrics and its stages' params."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    every = mlflow.search_runs(search_all_experiments=True, order_by=["attributes.start_time ASC"])
    if every.empty or "tags.pipeline_key" not in every:
        raise LookupError(f"no pipeline runs in the MLflow store {uri}; run `dvc repro` first")
    parents = every[every["tags.pipeline_key"].notna()].set_index("run_id")
    children = every[column(every, "tags.mlflow.parentRunId").notna()]
    params = [c for c in every.columns if c.startswith("params.")]
    if params and not children.empty:
        merged = children.groupby("tags.mlflow.parentRunId")[params].last()  # last non-null value per param
        parents = parents.drop(columns=params).join(merged)
    parents["flops_at_peak"] = (column(parents, "metrics.train.train_hours").astype(float) * 3600
                                * column(parents, "metrics.train.devices").astype(float)
                                * column(parents, "metrics.train.peak_flops").astype(float))
    return parents


def differing_params(runs: pd.DataFrame) -> list[str]:
    """The params columns whose values are not the same in every run (a missing value counts as a value)."""
    params = [c for c in runs.columns if c.startswith("params.") and c not in HIDDEN_PARAMS]
    return sorted(c for c in params if runs[c].astype(str).nunique() > 1)


def fmt(value: object, pattern: str = "{}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def device(run: pd.Series) -> str:
    n, name = run.get("metrics.train.devices"), run.get("tags.train.device")
    return "-" if name is None or pd.isna(name) else f"{fmt(n, '{:.0f}')} x {name}"


def report_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The report's table, one formatted row per run."""
    rows = []
    for _, run in runs.iterrows():
        row = {"run": fmt(run.get("tags.mlflow.runName")), "preset": fmt(run.get("tags.preset")),
               "commit": fmt(run.get("tags.git_commit"))[:8]}
        row |= {c.removeprefix("params."): fmt(run.get(c)) for c in differing_params(runs)}
        model = fmt(run.get(MODEL))[:8]
        row["model"] = model
        row |= {label: "-" if label in SCORES and model == "-" else fmt(run.get(source), pattern)
                for label, (source, pattern) in COLUMNS.items()}
        row["device"] = device(run)
        rows.append(row)
    return pd.DataFrame(rows)


def paper_table() -> pd.DataFrame:
    return pd.DataFrame([{"system": s, "pair": p, "BLEU (tokenized)": b, "training FLOPs": f"{f:.1e}"}
                         for s, p, b, f in PAPER_TABLE2])


def render_markdown(runs: pd.DataFrame, uri: str) -> str:
    """reports/report.md."""
    signatures = sorted(set(column(runs, "tags.eval.signature").dropna()))
    lines = [
        "# Runs", "",
        f"{len(runs)} pipeline run(s) from `{uri}`, oldest first. Params columns are those that differ "
        "between runs. model: the trained weights' params_hash; BLEU and chrF are shown only beside it. FLOPs: counted = model FLOPs over the tokens trained on; paper's way = hours x devices x "
        "sustained fp32 TFLOPS (Sec. 6.1); at peak = hours x devices x the device's peak.", "",
        report_table(runs).to_markdown(index=False, disable_numparse=True), "",
        "sacreBLEU signature(s): " + (", ".join(f"`{s}`" for s in signatures) or "-"), "",
        "# The paper (Table 2, newstest2014)", "",
        paper_table().to_markdown(index=False, disable_numparse=True), "",
        "![BLEU against training FLOPs](bleu_vs_flops.png)", "",
    ]
    return "\n".join(lines)


def plot_bleu_vs_flops(runs: pd.DataFrame) -> bytes:
    """PNG: tokenized BLEU against training FLOPs (log x) for our runs and the paper's Table 2."""
    fig = Figure(figsize=(8, 5.5), dpi=120)
    ax = fig.subplots()
    for pair, marker, color in (("EN-DE", "s", "0.2"), ("EN-FR", "^", "0.55")):
        points = [(f, b, s) for s, p, b, f in PAPER_TABLE2 if p == pair]
        ax.plot([f for f, _, _ in points], [b for _, b, _ in points], marker=marker, color=color, linestyle=":",
                markersize=8, label=f"paper, {pair} (Table 2)")
        for f, b, s in points:
            size = "big" if "big" in s else "base"
            ax.annotate(f"{size} {pair} {b}", (f, b), textcoords="offset points", xytext=(-8, 8), ha="right",
                        fontsize=8, color=color)
    bleu = column(runs, "metrics.eval.bleu_tokenized").astype(float)
    paper_way = column(runs, "metrics.train.flops_paper_estimate").astype(float)
    counted = column(runs, "metrics.train.flops_analytic").astype(float)
    scored = column(runs, MODEL).notna()
    shown = [run_id for run_id in runs.index if scored[run_id] and bleu[run_id] > 0 and paper_way[run_id] > 0]
    for i, run_id in enumerate(shown):
        run, color = runs.loc[run_id], f"C{i % 10}"
        ax.plot(paper_way[run_id], bleu[run_id], "o", color=color, markersize=8,
                label="ours, FLOPs the paper's way" if i == 0 else None)
        if counted[run_id] > 0:
            ax.plot([counted[run_id], paper_way[run_id]], [bleu[run_id]] * 2, color=color, linewidth=0.8)
            ax.plot(counted[run_id], bleu[run_id], "o", mfc="white", color=color, markersize=8,
                    label="ours, FLOPs counted" if i == 0 else None)
        ax.annotate(fmt(run.get("tags.mlflow.runName")), (paper_way[run_id], bleu[run_id]), textcoords="offset points",
                    xytext=(7, 5), fontsize=8, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (log scale)")
    ax.set_ylabel("BLEU (tokenized, compound-split, as the paper)")
    ax.set_title("BLEU against training cost")
    ax.grid(True, which="both", alpha=0.3)
    ax.margins(x=0.12, y=0.12)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else mlflow.db in the repo root")
    args = parser.parse_args(argv)
    cli.setup_logging()
    uri = args.tracking_uri or tracking.tracking_uri()
    runs = load_runs(uri)
    write_text(args.out / "report.md", render_markdown(runs, uri))
    write_bytes(args.out / "bleu_vs_flops.png", plot_bleu_vs_flops(runs))
    log.info("wrote %s and %s (%d runs)", args.out / "report.md", args.out / "bleu_vs_flops.png", len(runs))


if __name__ == "__main__":
    cli.run(main)
