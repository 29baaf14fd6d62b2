"""Which DVC records belong to a pipeline run: is a stage run by DVC, and which metrics files are current.

A stage is part of a pipeline run only when DVC runs it: `dvc repro` and `dvc exp run` set
DVC_STAGE to the stage's name and DVC_ROOT to the repository it runs in (dvc/stage/run.py,
prepare_kwargs; torchrun passes both on to its workers), except in a queued experiment's copy
(work_root). Anything else is a run by hand.

A metrics file describes the current pipeline run when DVC finds its stage, and
every stage upstream of it, unchanged against dvc.lock (DVC's own comparison of
command, deps, params and outputs), the stage that is running counting as
unchanged only once it has finished. So while train runs after a params change,
evaluate's eval.json (an earlier model's) never counts; once a re-run stage has
written the same outputs as before, the downstream stages DVC will skip do.
DVC's checks run without the repo lock (which the `dvc repro` running this
stage holds); its hashes go through DVC's state database, shared with DVC.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def run_by_dvc(stage: str) -> bool:
    """True when DVC runs `stage` ($DVC_STAGE names it), False for a stage run by hand."""
    return os.environ.get("DVC_STAGE", "").rsplit(":", 1)[-1] == stage  # `dir/dvc.yaml:name` outside the root


EXPS_TMP = Path(".dvc") / "tmp" / "exps"  # where `dvc exp run --queue` / `--temp` copies the repo to run it


def exp_copy_of(path: Path) -> Path | None:
    """The repository whose experiment copy (<repo>/.dvc/tmp/exps/...) holds `path`, or None."""
    parts = path.parts
    for i in range(len(parts) - len(EXPS_TMP.parts)):
        if Path(*parts[i : i + len(EXPS_TMP.parts)]) == EXPS_TMP:
            return Path(*parts[:i])
    return None


def work_root() -> Path:
    """The repository a stage runs in: $DVC_ROOT under DVC, else the nearest directory with dvc.yaml from the cwd up.

    Except in a queued or temp experiment: DVC sets $DVC_ROOT to the repository that queued it
    (dvc/repo/experiments/queue/base.py) while the stage runs in that repository's copy under
    .dvc/tmp/exps, whose dvc.lock and metrics files are this run's (the queueing repository's are another's).
    """
    here = Path.cwd().resolve()
    found = next((d for d in (here, *here.parents) if (d / "dvc.yaml").is_file()), here)
    if os.environ.get("DVC_ROOT"):
        root = Path(os.environ["DVC_ROOT"]).resolve()
        return found if exp_copy_of(found) == root else root
    return found


def unchanged(stage: Any) -> bool:
    """DVC's comparison of a stage's dvc.lock entry with the workspace (`dvc status` without the repo lock)."""
    return not (stage.changed_stage() or any(d.status() for d in stage.deps) or any(o.status() for o in stage.outs))


def current_metrics(root: Path, stage: str, finished: bool) -> list[Path]:
    """The metrics files of the other stages in root's dvc.yaml that describe this run (see above)."""
    if not (root / "dvc.lock").is_file():
        return []
    from dvc.repo import Repo
    from networkx import dfs_postorder_nodes  # DVC's own graph library

    with Repo(str(root)) as repo:
        graph = repo.index.graph
        running = next((s for s in graph if s.name == stage and Path(s.path).resolve().parent == root), None)
        known: dict[Any, bool] = {running: finished}

        def current(node: Any) -> bool:
            if node not in known:
                known[node] = unchanged(node)
            return known[node]

        found = []
        for node in graph:
            metrics = [Path(o.fs_path) for o in node.outs if o.metric]
            # upstream first (postorder), so a stage is checked only once all it depends on is current
            if metrics and node is not running and all(current(n) for n in dfs_postorder_nodes(graph, node)):
                found += metrics
        return sorted(found)
