"""What params mean together: conf/ composed into one params file, and the rules between its sections.

    compose(["experiment=multi30k_tiny"]) -> dict   # conf/config.yaml with Hydra overrides, as `dvc exp run -S`
    contradictions(sections, path)                   # refuse params that contradict each other, naming both keys

The rules are checked by `python -m pipeline.core.config` (config.load_all) and by every stage that loads one of
the sections they read (config.load: batch, which reads train.tokens_per_step, and every stage after it but
evaluate), on the sections its params file holds: a contradiction that a late stage would refuse is refused before
any training: compile_scope step with R-Drop, translate.engine ctranslate2 without an export, or with the project
engine's translate.precision; train.keep_checkpoints below average.last_n (the params check only). Imports no other module of pipeline.core but errors (pipeline/core/config.py imports this one).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.errors import ParamsError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
RULED = ("train", "average", "export", "translate")  # the sections the rules read
SHARE = {"range": "[0, 1]"}


@dataclass(frozen=True)
class MinIdentical:  # export.min_identical: per export.quantization, the least share of validation lines both
    # engines decode alike (conf/config.yaml says where the defaults were measured)
    none: float = field(default=0.995, metadata=SHARE)
    int8: float = field(default=0.9, metadata=SHARE)
    int8_float32: float = field(default=0.9, metadata=SHARE)
    int16: float = field(default=0.9, metadata=SHARE)
    bfloat16: float = field(default=0.9, metadata=SHARE)
    float16: float = field(default=0.9, metadata=SHARE)


def compose(overrides: list[str] = (), conf_dir: str | Path = CONF_DIR) -> dict:
    """Compose conf/config.yaml with Hydra overrides, as `dvc exp run -S` does: a fresh copy each call, composed once
    a process for the same overrides and the same bytes of conf/ (Hydra takes a fifth of a second a composition)."""
    conf_dir = Path(conf_dir).resolve()
    key = (tuple(overrides), str(conf_dir),
           tuple((str(p), hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(conf_dir.rglob("*.yaml"))))
    if key not in _composed:
        _composed[key] = _compose(list(overrides), conf_dir)
    return copy.deepcopy(_composed[key])


_composed: dict[tuple, dict] = {}  # compose()'s results in this process, by overrides and conf/'s contents


def _compose(overrides: list[str], conf_dir: Path) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except HydraException as e:
        presets = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in sorted(conf_dir.iterdir()) if g.is_dir()}
        raise ParamsError(f"{conf_dir}: cannot compose {overrides}: {e}; presets: {presets}") from None
    return OmegaConf.to_container(cfg, resolve=True)


def translate_engine(translate) -> None:
    """translate.precision is the project engine's: with the ctranslate2 engine, export.quantization says the type."""
    if translate.engine == "ctranslate2" and translate.precision != "auto":
        raise ParamsError(f"translate.precision = {translate.precision!r} sets the project engine's weights, and "
                          "translate.engine = ctranslate2 computes in export.quantization's type: set "
                          "translate.precision=auto (or translate.engine=project)")


def contradictions(sections: dict, path: str | Path, stage: bool = False) -> None:
    """Refuse params that contradict each other (`sections`: {name: its dataclass}, those present); `stage`: a stage
    loading its params, which leaves train.keep_checkpoints against average.last_n to the average stage (it counts
    the checkpoints there are, and its run records the failure)."""
    train, average, export, translate = (sections.get(name) for name in RULED)
    try:
        # Checked here, not by the train stage: reading average.last_n would re-run training when it changes.
        if train and average and not stage and train.keep_checkpoints < average.last_n:
            raise ParamsError(f"train.keep_checkpoints = {train.keep_checkpoints}: expected at least average.last_n "
                              f"= {average.last_n}, or there are not enough checkpoints to average")
        if train and train.compile_scope == "step" and (train.compile or train.cuda_graphs) and train.rdrop_alpha > 0:
            raise ParamsError(f"train.compile_scope = step compiles the plain loss, and train.rdrop_alpha = "
                              f"{train.rdrop_alpha:g} asks for R-Drop: set train.compile_scope=layers (or "
                              "train.rdrop_alpha=0)")
        if translate and export and translate.engine == "ctranslate2" and not export.enabled:
            raise ParamsError("translate.engine = ctranslate2 decodes the export, and export.enabled = false writes "
                              "none: set export.enabled=true (or translate.engine=project)")
        if translate:
            translate_engine(translate)
    except ParamsError as e:
        raise ParamsError(f"{path}: {e}") from None
