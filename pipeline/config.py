"""Typed, strict access to params.yaml: one frozen dataclass per section.

    python -m pipeline.config params.yaml     # validate every section, print OK
    python -m pipeline.config --compose params.yaml [experiment=NAME ...]
                                            # write conf/ composed (what `dvc exp run -S` does)

Field names are the params keys (the paper's symbols). There are no defaults:
a missing, unknown or mistyped key fails at load with its dotted name.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from model.config import ModelConfig

T = TypeVar("T")


class ParamsError(ValueError):
    """A params file does not match the schema; the message names the key."""


# --- data -------------------------------------------------------------------


@dataclass(frozen=True)
class FileSource:
    """One file the pipeline uses: its official URL and the sha256 it must have.

    `member` is the path inside an archive URL (.tgz/.tar.gz/.tar), else null.
    `sha256` is of the file itself, or of the member for an archive. null means
    not pinned yet (only allowed over https; the download warns and records the
    hash it saw).
    """

    url: str
    member: str | None
    sha256: str | None


@dataclass(frozen=True)
class ParallelCorpus:
    """An aligned pair of files; a split concatenates its corpora in order."""

    name: str
    src: FileSource
    tgt: FileSource


@dataclass(frozen=True)
class DataConfig:
    name: str
    src_lang: str
    tgt_lang: str
    train: tuple[ParallelCorpus, ...]
    valid: tuple[ParallelCorpus, ...]
    test: tuple[ParallelCorpus, ...]


@dataclass(frozen=True)
class TokenizeConfig:
    model_type: str  # sentencepiece model type: "bpe" or "unigram"
    vocab_size: int
    character_coverage: float
    input_sentence_size: int  # sentences sampled to train sentencepiece; 0 = all
    max_len: int  # training pairs longer than this (in tokens, either side) are dropped
    max_len_ratio: float  # ... and pairs whose longer/shorter length ratio exceeds this
    seed: int


@dataclass(frozen=True)
class BatchConfig:
    max_tokens: int  # padded tokens per batch and device, each side: n pairs x the longest side of the longest pair
    seed: int


# --- model and training -------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    devices: int  # torchrun processes (GPUs, or CPU processes)
    tokens_per_step: int  # padded tokens (batch.max_tokens' units) per optimizer step; sets gradient accumulation
    max_steps: int
    max_minutes: float  # wall-clock safety stop, 0 = none; recorded as metrics stopped_by = "max_minutes" when it fires
    warmup_steps: int
    lr_factor: float  # multiplies the paper's schedule (1.0 = the paper)
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    label_smoothing: float
    eval_every: int  # steps between validation runs
    log_every: int  # steps between logged training points
    checkpoint_minutes: float  # 0 = off
    checkpoint_every: int  # steps; 0 = off
    keep_checkpoints: int
    seed: int


@dataclass(frozen=True)
class AverageConfig:
    last_n: int


@dataclass(frozen=True)
class TranslateConfig:
    beam_size: int
    length_penalty: float  # alpha of the GNMT penalty ((5 + |Y|) / 6)^alpha
    max_len_a: float  # maximum output length = max_len_a * source length + max_len_b
    max_len_b: int
    max_tokens: int  # source tokens per decoding batch


@dataclass(frozen=True)
class EvaluateConfig:
    tokenize: str  # sacreBLEU tokenizer ("13a")


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "tokenize": TokenizeConfig,
    "batch": BatchConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "average": AverageConfig,
    "translate": TranslateConfig,
    "evaluate": EvaluateConfig,
}


# --- strict conversion ----------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to `tp`, or raise ParamsError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, key)
    if origin is tuple:
        if not isinstance(value, list):
            raise ParamsError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _to_dataclass(value, tp, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ParamsError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _to_dataclass(raw: Any, cls: type[T], key: str) -> T:
    if not isinstance(raw, dict):
        raise ParamsError(f"{key}: expected a mapping of {cls.__name__} fields, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ParamsError(f"{key}: unknown key(s) {', '.join(f'{key}.{u}' for u in unknown)}; expected {names}")
    missing = [n for n in names if n not in raw]
    if missing:
        raise ParamsError(f"{key}: missing key(s) {', '.join(f'{key}.{m}' for m in missing)}")
    return cls(**{n: _convert(raw[n], hints[n], f"{key}.{n}") for n in names})


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with the file name in any error."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    return raw


def parse(raw: dict, section: str, cls: type[T]) -> T:
    """One section of already-read params (e.g. compose()'s result) as its frozen dataclass."""
    if section not in raw:
        raise ParamsError(f"missing section '{section}'")
    return _to_dataclass(raw[section], cls, section)


def load(path: str | Path, section: str, cls: type[T]) -> T:
    """Load one section of a params file into its frozen dataclass."""
    raw = read_yaml(path)
    try:
        return parse(raw, section, cls)
    except ParamsError as e:
        raise ParamsError(f"{path}: {e}") from None


def load_all(path: str | Path) -> dict[str, Any]:
    """Load and validate every section; unknown sections are an error too."""
    raw = read_yaml(path)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ParamsError(f"{path}: unknown section(s) {unknown}; expected {list(SECTIONS)}")
    return {name: load(path, name, cls) for name, cls in SECTIONS.items()}


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
HEADER = "# Composed from conf/ (the comments and paper citations live there):\n#   python -m pipeline.config --compose params.yaml\n"


def compose(overrides: list[str] = (), conf_dir: str | Path = CONF_DIR) -> dict:
    """Compose conf/config.yaml with Hydra overrides, as `dvc exp run -S` does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    conf_dir = Path(conf_dir).resolve()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except HydraException as e:
        presets = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in sorted(conf_dir.iterdir()) if g.is_dir()}
        raise ParamsError(f"{conf_dir}: cannot compose {list(overrides)}: {e}; presets: {presets}") from None
    return OmegaConf.to_container(cfg, resolve=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--compose":
        path, overrides = argv[1], argv[2:]
        from pipeline.files import write_text

        write_text(path, HEADER + yaml.safe_dump(compose(overrides), sort_keys=False))
    path = argv[1] if argv and argv[0] == "--compose" else (argv[0] if argv else "params.yaml")
    load_all(path)
    print(f"{path}: OK ({', '.join(SECTIONS)})")


if __name__ == "__main__":
    main()
