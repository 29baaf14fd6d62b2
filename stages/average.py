"""Average the last checkpoints into the one model that is evaluated (Sec. 6.1).

    python -m stages.average --checkpoints data/checkpoints --out data/model [--params params.yaml]

Reads params `average` (AverageConfig). Sec. 6.1: "For the base models, we used
a single model obtained by averaging the last 5 checkpoints ... For the big
models, we averaged the last 20 checkpoints." The parameter-wise mean of the
newest `last_n` complete checkpoints (pipeline/weights/averaging.py: exact in float64,
so `last_n: 1` returns the newest weights bit for bit; checkpoints that do not
belong together are refused, naming the files).

data/model/ (replaced whole, atomically):
    model.pt        {"model", "model_config", "vocab_size", "steps", "params_hash"}
    model.pt.sha256 its seal, as a checkpoint's (translate and export check it before reading the model)
    averaged.json   the steps and files averaged
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from pipeline.core import cli, config, tracking
from pipeline.weights.averaging import average_checkpoints
from pipeline.weights.checkpoint import save_sealed
from pipeline.core.config import AverageConfig
from pipeline.core.files import atomic_dir, write_json

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    args = cli.start(__doc__, argv, "checkpoints", "out")
    cfg = config.load(args.params, "average", AverageConfig)
    with tracking.stage_run("average", args) as run:
        run.log_params({"average": asdict(cfg)})
        averaged, paths = average_checkpoints(args.checkpoints, cfg.last_n)
        with atomic_dir(args.out) as tmp:
            save_sealed(tmp / "model.pt", averaged)
            write_json(tmp / "averaged.json", {"steps": averaged["steps"], "checkpoints": [p.name for p in paths]})
        log.info("averaged steps %s into %s", averaged["steps"], args.out / "model.pt")
        run.log_metrics({"averaged_checkpoints": len(paths), "first_step": averaged["steps"][0],
                         "last_step": averaged["steps"][-1]})


if __name__ == "__main__":
    cli.run(main)
