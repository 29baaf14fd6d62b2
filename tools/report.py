"""Compare the pipeline runs recorded in MLflow with each other and with the paper's Table 2.

    python -m tools.report [--out reports/] [--tracking-uri sqlite:///mlflow.db]

Not a DVC stage: it reads every pipeline run in the MLflow store (the tracking
URI of pipeline.core.tracking unless given) and writes

    reports/report.md            one row per configuration: its runs (n), preset, the params
                                 that differ between runs, the models scored, BLEU both
                                 ways, chrF, valid perplexity, training tokens, training
                                 FLOPs three ways, hours, devices, the frontier; then the paper's rows
    reports/bleu_vs_flops.png    BLEU against training FLOPs (log x), ours and the paper's
    reports/bleu_vs_flops.csv    the same table, unformatted: `<column> mean|sd|min|max`

Runs that differ only by seed (tools/seeds.py queues them) are one
configuration (tools/groups.py): one row and one point, the mean over the seeds;
BLEU, chrF, valid perplexity and training tokens also show the standard
deviation and [min, max] (`mean +- sd [min, max]`), and the plot an error bar
of one standard deviation. `frontier`: the configurations on the best
BLEU-for-FLOPs frontier, tokenized BLEU against FLOPs counted (which, unlike
hours, do not depend on the machine or its load): no other has at least the
BLEU for at most the FLOPs.

Where the numbers live (pipeline/core/tracking.py): a pipeline run is a parent run
tagged `pipeline_key` (and preset, git_commit, dvc_exp_name); its metrics are
the DVC metrics files as `<file stem>.<key>` (eval.bleu, train.flops_analytic...),
their strings as tags (train.device, eval.signature); the params are on its
child runs, one per stage, under their params.yaml names (model.d_model...).
Only a pipeline run's own records are there (pipeline/core/lineage.py); runs by hand
(tag hand_run) are not pipeline runs and are left out. The `model` column is the
trained weights' params_hash (train.params_hash: model, train params, data); a
run's BLEU and chrF count only beside the model they came from.

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

from pipeline.core import cli, tracking
from pipeline.core.files import write_bytes, write_text
from tools import groups

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
    "valid ppl": ("metrics.train.valid_ppl", "{:.2f}"),
    "train tokens": ("metrics.train.train_tokens", "{:,.0f}"),
    "hours": ("metrics.train.train_hours", "{:.2f}"),
    "FLOPs counted": ("metrics.train.flops_analytic", "{:.2e}"),
    "FLOPs paper's way": ("metrics.train.flops_paper_estimate", "{:.2e}"),
    "FLOPs at peak": ("flops_at_peak", "{:.2e}"),
    "MFU": ("metrics.train.mfu", "{:.1%}"),
}
SPREAD = {"BLEU (sacreBLEU)", "BLEU (tokenized, as the paper)", "chrF", "valid ppl", "train tokens"}  # sd, min, max
FRONTIER = ("FLOPs counted", "BLEU (tokenized, as the paper)")  # cost, quality


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
    """The params columns whose values are not the same in every run (runs that never logged one are left out)."""
    params = [c for c in runs.columns if c.startswith("params.") and c not in HIDDEN_PARAMS]
    return sorted(c for c in params if groups.varies(runs, c))


def fmt(value: object, pattern: str = "{}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def device(run: pd.Series) -> str:
    n, name = run.get("metrics.train.devices"), run.get("tags.train.device")
    return "-" if name is None or pd.isna(name) else f"{fmt(n, '{:.0f}')} x {name}"


def configurations(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (runs that differ only by seed), unformatted, with the frontier: the CSV."""
    runs = runs.assign(_commit=column(runs, "tags.git_commit").str[:8], _model=column(runs, MODEL).str[:8],
                       _device=[device(run) for _, run in runs.iterrows()])
    scores = [source for label, (source, _) in COLUMNS.items() if label in SCORES and source in runs]
    runs.loc[runs[MODEL].isna() if MODEL in runs else runs.index, scores] = float("nan")  # no model, no scores
    labels = {"preset": "tags.preset", "commit": "_commit", "stopped by": "tags.train.stopped_by"}
    labels |= {c.removeprefix("params."): c for c in differing_params(runs)}
    table = groups.summarize(runs, HIDDEN_PARAMS, labels | {"model": "_model", "device": "_device"},
                             {label: source for label, (source, _) in COLUMNS.items()}, SPREAD)
    table["frontier"] = groups.on_frontier(*(table[f"{label} mean"] for label in FRONTIER))
    return table


def cell(row: pd.Series, label: str, pattern: str) -> str:
    """`mean`, or `mean +- sd [min, max]` for a metric that spreads over seeds and has two runs or more."""
    mean = fmt(row[f"{label} mean"], pattern)
    if label not in SPREAD or pd.isna(row[f"{label} sd"]):
        return mean
    sd, low, high = (fmt(row[f"{label} {stat}"], pattern) for stat in ("sd", "min", "max"))
    return f"{mean} ± {sd} [{low}, {high}]"


def report_table(table: pd.DataFrame) -> pd.DataFrame:
    """The report's table: configurations() formatted, one row per configuration."""
    shown = [c for c in table.columns if c not in ("device", "frontier") and not c.endswith(tuple(f" {stat}" for stat in groups.STATS))]
    rows = []
    for _, config in table.iterrows():
        row = {c: fmt(config[c]) for c in shown}
        row |= {label: cell(config, label, pattern) for label, (_, pattern) in COLUMNS.items()}
        row |= {"device": fmt(config["device"]), "frontier": "yes" if config["frontier"] else ""}
        rows.append(row)
    return pd.DataFrame(rows)


def paper_table() -> pd.DataFrame:
    return pd.DataFrame([{"system": s, "pair": p, "BLEU (tokenized)": b, "training FLOPs": f"{f:.1e}"}
                         for s, p, b, f in PAPER_TABLE2])


def render_markdown(runs: pd.DataFrame, table: pd.DataFrame, uri: str) -> str:
    """reports/report.md: the configurations' table (configurations()), formatted."""
    signatures = sorted(set(column(runs, "tags.eval.signature").dropna()))
    lines = [
        "# Runs", "",
        f"{len(runs)} pipeline run(s) from `{uri}` as {len(table)} configuration(s), oldest first: runs that differ "
        "only by seed are one row, n runs, `mean ± sd [min, max]` over them (sd: n - 1). Params columns are those "
        "that differ between runs. model: the trained weights' params_hash; BLEU and chrF count only beside it. "
        "FLOPs: counted = model FLOPs over the tokens trained on; paper's way = hours x devices x "
        "sustained fp32 TFLOPS (Sec. 6.1); at peak = hours x devices x the device's peak. frontier: no other "
        "configuration has at least its tokenized BLEU for at most its FLOPs counted. stopped by: max_minutes marks "
        "runs that the wall-clock safety stop (train.max_minutes) ended before train.max_steps: their steps depend "
        "on the machine and its load.", "",
        report_table(table).to_markdown(index=False, disable_numparse=True), "",
        "sacreBLEU signature(s): " + (", ".join(f"`{s}`" for s in signatures) or "-"), "",
        "# The paper (Table 2, newstest2014)", "",
        paper_table().to_markdown(index=False, disable_numparse=True), "",
        "![BLEU against training FLOPs](bleu_vs_flops.png)", "",
        "The table as CSV: [bleu_vs_flops.csv](bleu_vs_flops.csv)", "",
    ]
    return "\n".join(lines)


def plot_bleu_vs_flops(table: pd.DataFrame) -> bytes:
    """PNG: tokenized BLEU (+- sd) against training FLOPs (log x), our configurations, their frontier, the paper's."""
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
    quality = FRONTIER[1]
    bleu, sd = table[f"{quality} mean"].astype(float), table[f"{quality} sd"].astype(float).fillna(0)
    paper_way = table["FLOPs paper's way mean"].astype(float)
    counted = table["FLOPs counted mean"].astype(float)
    shown = [i for i in table.index if bleu[i] > 0 and paper_way[i] > 0]
    for k, i in enumerate(shown):
        color = f"C{k % 10}"
        ax.errorbar(paper_way[i], bleu[i], yerr=sd[i], fmt="o", color=color, markersize=8, capsize=4,
                    label="ours (± 1 sd over seeds), FLOPs the paper's way" if k == 0 else None)
        if counted[i] > 0:
            ax.plot([counted[i], paper_way[i]], [bleu[i]] * 2, color=color, linewidth=0.8)
            ax.errorbar(counted[i], bleu[i], yerr=sd[i], fmt="o", mfc="white", color=color, markersize=8, capsize=4,
                        label="ours, FLOPs counted" if k == 0 else None)
        name = table.at[i, "run"].split(", ")[0] + (f" (n={table.at[i, 'n']})" if table.at[i, "n"] > 1 else "")
        ax.annotate(name, (paper_way[i], bleu[i]), textcoords="offset points", xytext=(7, 5), fontsize=8, color=color)
    best = table[table["frontier"]].sort_values("FLOPs counted mean")
    if len(best):
        ax.plot(best["FLOPs counted mean"], best[f"{quality} mean"], "*--", color="k", linewidth=0.8, markersize=11,
                mfc="none", label="BLEU-for-FLOPs frontier (FLOPs counted)")
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
    table = configurations(runs)
    write_text(args.out / "report.md", render_markdown(runs, table, uri))
    write_bytes(args.out / "bleu_vs_flops.png", plot_bleu_vs_flops(table))
    write_text(args.out / "bleu_vs_flops.csv", table.to_csv(index=False))
    log.info("wrote %s, %s and %s (%d runs, %d configurations)", args.out / "report.md",
             args.out / "bleu_vs_flops.png", args.out / "bleu_vs_flops.csv", len(runs), len(table))


if __name__ == "__main__":
    cli.run(main)
