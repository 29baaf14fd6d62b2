"""Which DVC records belong to a pipeline run: is a stage run by DVC, and which metrics files are current.

A stage is part of a pipeline run only when DVC runs it: `dvc repro` and `dvc exp run` set
DVC_STAGE to the stage's name and DVC_ROOT to the repository it runs in (dvc/stage/run.py,
prepare_kwargs; torchrun passes both on to its workers). Anything else is a run by hand.

A metrics file describes the current pipeline run when its stage is upstream of the running one
(`dvc repro` has brought every upstream stage up to date before it starts this one) and DVC's own
comparison of dvc.lock with the workspace finds that stage unchanged: same command, deps, params
and outputs. Downstream files (an evaluate from an earlier model while train runs) never count.
DVC's checks run without the repo lock (which the `dvc repro` running this stage holds); its
hashes come from DVC's state database, so large outputs are not read again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def run_by_dvc(stage: str) -> bool:
    """True when DVC runs `stage` ($DVC_STAGE names it), False for a stage run by hand."""
    return os.environ.get("DVC_STAGE", "").rsplit(":", 1)[-1] == stage  # `dir/dvc.yaml:name` outside the root


def work_root() -> Path:
    """The repository a stage runs in: $DVC_ROOT under DVC, else the nearest directory with dvc.yaml from the cwd up."""
    if os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    here = Path.cwd().resolve()
    return next((d for d in (here, *here.parents) if (d / "dvc.yaml").is_file()), here)


def unchanged(stage: Any) -> bool:
    """DVC's comparison of a stage's dvc.lock entry with the workspace (`dvc status` without the repo lock)."""
    return not (stage.changed_stage() or any(d.status() for d in stage.deps) or any(o.status() for o in stage.outs))


def upstream_metrics(root: Path, stage: str) -> list[Path]:
    """The metrics files of the stages upstream of `stage` in root's dvc.yaml that dvc.lock records as current."""
    if not (root / "dvc.lock").is_file():
        return []
    from dvc.repo import Repo
    from dvc.repo.graph import get_subgraph_of_nodes

    with Repo(str(root)) as repo:
        graph = repo.index.graph
        node = next((s for s in graph if s.name == stage and Path(s.path).resolve().parent == root), None)
        if node is None:
            return []
        upstream = [s for s in get_subgraph_of_nodes(graph, [node]) if s is not node]
        return sorted(Path(o.fs_path) for s in upstream if unchanged(s) for o in s.outs if o.metric)
