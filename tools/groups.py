"""Runs that differ only by seed, as one configuration; the configurations on the BLEU-for-FLOPs frontier.

Used by tools/report.py. Two pipeline runs are one configuration when they
share the git commit, the preset and every param but the seeds
(tools/seeds.SEEDS: train.seed, batch.seed) and those that always differ
(`ignored`: the train stage's params_hash, the device). A configuration's
figures are the mean over its runs, with, for the metrics that spread over
seeds, the sample standard deviation (n - 1; none for one run), min and max;
each over the runs that have the metric.

The frontier: a configuration is on it when no other has at least its BLEU for
at most its FLOPs, and more BLEU or fewer FLOPs (Pareto); one without both
figures is not on it.
"""

from __future__ import annotations

import pandas as pd

from tools.seeds import SEEDS

SEED_PARAMS = {f"params.{p}" for p in SEEDS}
SAME_IN_A_GROUP = ("tags.git_commit", "tags.preset")
STATS = ("mean", "sd", "min", "max")


def varies(runs: pd.DataFrame, column: str) -> bool:
    """Whether two runs logged `column` differently (a run that never logged it is left out, not a value)."""
    return runs[column].dropna().astype(str).nunique() > 1


def config_keys(runs: pd.DataFrame, ignored: set[str]) -> pd.Series:
    """Per run, a key that runs differing only by seed (and by `ignored` params) share."""
    # A param that no two runs log differently tells no configurations apart: a run that DVC served a stage from
    # its cache never logged that stage's params (missing is not a value), so it is left out of the key.
    params = sorted(c for c in runs.columns if c.startswith("params.") and c not in SEED_PARAMS | ignored
                    and varies(runs, c))
    same = runs.reindex(columns=[*SAME_IN_A_GROUP, *params]).fillna("").astype(str)  # pandas 3 keeps NaN through astype(str)
    return same.apply(lambda row: "\x1f".join(row), axis=1) if len(same.columns) else pd.Series("", runs.index)


def values(members: pd.DataFrame, name: str) -> list[str]:
    """The distinct values of a column among a group's runs, in run order, missing ones left out."""
    found = members[name].dropna().astype(str) if name in members else pd.Series(dtype=str)
    return list(dict.fromkeys(found))


def summarize(runs: pd.DataFrame, ignored: set[str], labels: dict[str, str], metrics: dict[str, str],
              spread: set[str]) -> pd.DataFrame:
    """One row per configuration, in the order of its first run: `run` (the run names), `n` (runs), the distinct
    values of the columns in `labels` ({label: column of runs}, ", "-joined), each metric's `<label> mean` and, for those in
    `spread`, `<label> sd|min|max` (metrics: {label: column of runs})."""
    rows = []
    for _, members in runs.groupby(config_keys(runs, ignored), sort=False):
        row = {"run": ", ".join(values(members, "tags.mlflow.runName")) or "-", "n": len(members)}
        row |= {label: ", ".join(values(members, source)) or None for label, source in labels.items()}
        for label, source in metrics.items():
            found = pd.to_numeric(members[source], errors="coerce").dropna() if source in members else pd.Series()
            row[f"{label} mean"] = found.mean() if len(found) else None
            if label in spread:
                row |= {f"{label} sd": found.std() if len(found) > 1 else None,
                        f"{label} min": found.min() if len(found) else None,
                        f"{label} max": found.max() if len(found) else None}
        rows.append(row)
    return pd.DataFrame(rows)


def on_frontier(flops: pd.Series, bleu: pd.Series) -> pd.Series:
    """Whether each point is on the BLEU-for-FLOPs frontier: no other point has >= BLEU for <= FLOPs, one strictly."""
    flops, bleu = pd.to_numeric(flops, errors="coerce"), pd.to_numeric(bleu, errors="coerce")
    known = flops.notna() & bleu.notna()

    def dominated(i) -> bool:
        others = known & (bleu >= bleu[i]) & (flops <= flops[i]) & ((bleu > bleu[i]) | (flops < flops[i]))
        return bool(others.any())

    return pd.Series([bool(known[i]) and not dominated(i) for i in flops.index], index=flops.index, dtype=bool)
