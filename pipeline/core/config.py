"""Typed, strict access to params.yaml: one frozen dataclass per section.

    python -m pipeline.core.config params.yaml     # validate every section, print OK
    python -m pipeline.core.config --compose params.yaml [experiment=NAME ...]  # conf/ composed, as `dvc exp run -S`

Field names are the params keys (the paper's symbols). There are no defaults: a missing, unknown or mistyped key
fails at load with its dotted name, and so does a value outside the range or set its field declares (see "what a
value may be"), naming the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, TypeVar

import yaml

from model.config import ModelConfig
from pipeline.core.checks import CONF_DIR, RULED, SHARE, MinIdentical, compose, contradictions
from pipeline.core.errors import ParamsError

T = TypeVar("T")


# --- what a value may be ------------------------------------------------------------
# Every field declares its valid values in its metadata, checked at load with the key's name:
#   "range": an interval such as "[1, inf)" or "(0, 1]" for a number; for a list, its number of items
#   "multiple_of": an integer the value must be a multiple of
#   "choices": the allowed strings
#   "format": a FORMATS name, the form a string must have (None passes where the type allows it)


def safe_relpath(path: str) -> bool:
    """True for a relative path that stays inside the directory it is joined to."""
    parts = PurePosixPath(path).parts
    return bool(parts) and not path.startswith("/") and ".." not in parts and "\\" not in path


def url_parts(url: str) -> tuple[str, str]:
    """(host, unquoted path) of an http(s) URL naming a file: the mirror and cache layout (pipeline/corpus/fetch.py)."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path).lstrip("/")
    if parts.scheme not in ("http", "https") or not parts.netloc or path.endswith("/") or not safe_relpath(path):
        raise ValueError(f"not an http(s) URL of a file: {url!r}")
    return parts.netloc, path


def _is_file_url(url: str) -> bool:
    try:
        return bool(url_parts(url))
    except ValueError:
        return False


FORMATS: dict[str, tuple[Callable[[str], bool], str]] = {
    "name": (re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*").fullmatch, "letters, digits, '.', '_' or '-'"),
    "lang": (re.compile(r"[a-z]{2,3}").fullmatch, "a 2- or 3-letter lowercase language code"),
    "url": (_is_file_url, "an http(s) URL of a file"),
    "member": (safe_relpath, "a relative path inside the archive, without '..'"),
    "sha256": (re.compile(r"[0-9a-f]{64}").fullmatch, "64 lowercase hex digits"),
}
SEED = {"range": "[0, 4294967295]"}  # numpy's and torch's seeds
QUANTIZATIONS = ("none", "int8", "int8_float32", "int16", "bfloat16", "float16")  # CTranslate2's, for a CPU or GPU


# --- data -------------------------------------------------------------------


@dataclass(frozen=True)
class FileSource:
    """One file the pipeline uses: its official URL and the sha256 it must have. `member`: the path inside an
    archive URL (.tgz/.tar.gz/.tar), else null. `sha256`: of the file, or of the member; null = not pinned yet (only
    over https; the download warns and records the hash it saw)."""

    url: str = field(metadata={"format": "url"})
    member: str | None = field(metadata={"format": "member"})
    sha256: str | None = field(metadata={"format": "sha256"})


@dataclass(frozen=True)
class ParallelCorpus:
    """An aligned pair of files; a split concatenates its corpora in order."""

    name: str = field(metadata={"format": "name"})
    src: FileSource
    tgt: FileSource


@dataclass(frozen=True)
class DataConfig:
    name: str = field(metadata={"format": "name"})
    src_lang: str = field(metadata={"format": "lang"})  # also a file suffix: data/raw/train.{src_lang}
    tgt_lang: str = field(metadata={"format": "lang"})  # must differ from src_lang (checked at load)
    train: tuple[ParallelCorpus, ...] = field(metadata={"range": "[1, inf)"})
    valid: tuple[ParallelCorpus, ...] = field(metadata={"range": "[1, inf)"})
    test: tuple[ParallelCorpus, ...] = field(metadata={"range": "[1, inf)"})


@dataclass(frozen=True)
class TokenizeConfig:
    model_type: str = field(metadata={"choices": ("bpe", "unigram")})  # sentencepiece model type
    # above the 4 special ids; at most 65536: ids are stored as uint16 (pipeline/corpus/formats.py)
    vocab_size: int = field(metadata={"range": "[5, 65536]"})
    character_coverage: float = field(metadata={"range": "(0, 1]"})
    input_sentence_size: int = field(metadata={"range": "[0, inf)"})  # sentences sampled to train sentencepiece; 0: all
    # training pairs longer than this (in tokens, either side) are dropped ...
    max_len: int = field(metadata={"range": "[1, inf)"})
    max_len_ratio: float = field(metadata={"range": "[1, inf)"})  # ... and pairs whose longer/shorter ratio exceeds this
    seed: int = field(metadata=SEED)


@dataclass(frozen=True)
class BatchConfig:
    # padded tokens per stored batch, each side: n pairs x the longest side of the longest pair (bucketed)
    max_tokens: int = field(metadata={"range": "[1, inf)"})
    seed: int = field(metadata=SEED)
    # lengths padded up to a geometric grid of this ratio (pipeline/corpus/batching.py, bucket_grid); 1.0 = exact
    length_bucket_step: float = field(default=1.0, metadata={"range": "[1, 2]"})


# --- model and training -------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    devices: int = field(metadata={"range": "[1, inf)"})  # processes (GPUs, or CPU processes)
    # padded tokens (batch.max_tokens' units) per optimizer step; sets gradient accumulation
    tokens_per_step: int = field(metadata={"range": "[1, inf)"})
    max_steps: int = field(metadata={"range": "[1, inf)"})
    # wall-clock safety stop, 0 = none; recorded as metrics stopped_by = "max_minutes" when it fires
    max_minutes: float = field(metadata={"range": "[0, inf)"})
    warmup_steps: int = field(metadata={"range": "[1, inf)"})
    lr_factor: float = field(metadata={"range": "(0, inf)"})  # multiplies the paper's schedule (1.0 = the paper)
    adam_beta1: float = field(metadata={"range": "[0, 1)"})
    adam_beta2: float = field(metadata={"range": "[0, 1)"})
    adam_eps: float = field(metadata={"range": "(0, inf)"})
    label_smoothing: float = field(metadata={"range": "[0, 1)"})
    eval_every: int = field(metadata={"range": "[0, inf)"})  # steps between validation runs; 0 = at the end only
    log_every: int = field(metadata={"range": "[1, inf)"})  # steps between logged training points
    checkpoint_every: int = field(metadata={"range": "[0, inf)"})  # steps; 0 = off
    keep_checkpoints: int = field(metadata={"range": "[1, inf)"})  # at least average.last_n (checked by load_all)
    seed: int = field(metadata=SEED)
    # a collective (all-reduce, broadcast) waiting this long fails the run: a node died or froze
    timeout_minutes: float = field(metadata={"range": "(0, inf)"})
    # torch.compile (pipeline/device/compiled.py) each encoder and decoder layer, or the whole step (compile_scope:
    # forward, loss and backward as one graph; not with R-Drop); eager if compiling fails
    compile: bool = field(metadata={})
    compile_scope: str = field(default="layers", metadata={"choices": ("layers", "step")})
    compile_recompile_limit: int = field(default=8, metadata={"range": "[1, inf)"})  # graphs a compiled function
    compile_on_limit: str = field(default="eager", metadata={"choices": ("eager", "fail")})
    # the compiled graphs replayed as CUDA graphs (mode="reduce-overhead", pipeline/device/graphs.py); CUDA only
    cuda_graphs: bool = field(default=False, metadata={})
    # padded tokens per micro-batch (a process's share of a step split by rows: pipeline/training/plan.py);
    # 0 = from the device: the whole share on a CPU, what fits the memory on a GPU
    micro_batch_tokens: int = field(default=0, metadata={"range": "[0, inf)"})
    # decoupled weight decay (AdamW) of the weight matrices and embeddings; 0 = none, the paper's Adam
    weight_decay: float = field(default=0.0, metadata={"range": "[0, inf)"})
    # adam: the paper's, every parameter; muon: Muon for the layers' weight matrices, Adam for the rest
    # (pipeline/training/optimizer.py MuonAdam); the muon_* keys are Muon's and change nothing under adam
    optimizer: str = field(default="adam", metadata={"choices": ("adam", "muon")})
    muon_lr_factor: float = field(default=1.0, metadata={"range": "(0, inf)"})  # multiplies the schedule for Muon
    muon_momentum: float = field(default=0.95, metadata={"range": "[0, 1)"})
    muon_nesterov: bool = field(default=True, metadata={})
    muon_ns_steps: int = field(default=5, metadata={"range": "[1, 99]"})  # Newton-Schulz iterations (torch: < 100)
    # R-Drop's alpha (model/rdrop.py): each pair through the model twice, the two passes' distributions held
    # together by a KL term; 0 = none, the paper's loss. Twice the training FLOPs a step
    rdrop_alpha: float = field(default=0.0, metadata={"range": "[0, inf)"})
    # the share of each batch's rows that pass twice with R-Drop (drawn anew each step); 1 = all of them
    rdrop_fraction: float = field(default=1.0, metadata={"range": "(0, 1]"})
    # a CPU's matrix products: fp32, blas, bf16, auto or autocast (conf/config.yaml says each; GPUs ignore it). How a
    # step computes, never what it trains: the run's Precision (pipeline/device/precision.py) is recorded and hashed
    cpu_matmul: str = field(default="fp32", metadata={"choices": ("auto", "fp32", "blas", "bf16", "autocast")})
    # DDP with devices > 1: bucket MiB, static_graph, the all-reduce's precision (docs/paper_scale.md, "The all-reduce")
    ddp_bucket_mb: float = field(default=25.0, metadata={"range": "(0, inf)"})
    ddp_static_graph: bool = field(default=False, metadata={})
    grad_compression: str = field(default="none", metadata={"choices": ("none", "fp16", "bf16")})


@dataclass(frozen=True)
class AverageConfig:
    last_n: int = field(metadata={"range": "[1, inf)"})


@dataclass(frozen=True)
class TranslateConfig:
    beam_size: int = field(metadata={"range": "[1, inf)"})
    length_penalty: float = field(metadata={"range": "[0, inf)"})  # alpha of the GNMT penalty ((5 + |Y|) / 6)^alpha
    # maximum output length = max_len_a * source length + max_len_b
    max_len_a: float = field(metadata={"range": "[0, inf)"})
    max_len_b: int = field(metadata={"range": "[0, inf)"})
    max_tokens: int = field(metadata={"range": "[1, inf)"})  # source tokens per decoding batch
    engine: str = field(default="project", metadata={"choices": ("project", "ctranslate2")})  # or the export's model
    # the project engine's weights: auto (fp32 on every device, measured never slower: pipeline/translation/decoding.py), or forced
    precision: str = field(default="auto", metadata={"choices": ("auto", "fp32", "bf16", "fp16")})


@dataclass(frozen=True)
class ExportConfig:
    enabled: bool = field(metadata={})  # false: the export stage writes only a note saying so
    quantization: str = field(metadata={"choices": QUANTIZATIONS})  # model.bin's weights; none = float32, as trained
    check_lines: int = field(metadata={"range": "[0, inf)"})  # validation lines both engines decode; 0 = all
    min_identical: MinIdentical = field(default_factory=MinIdentical, metadata={})  # below: the stage fails


@dataclass(frozen=True)
class EvaluateConfig:  # tokenize: sacreBLEU's tokenizer; those that need no extra package or download
    tokenize: str = field(metadata={"choices": ("13a", "intl", "char", "zh", "none")})


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "tokenize": TokenizeConfig,
    "batch": BatchConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "average": AverageConfig,
    "export": ExportConfig,
    "translate": TranslateConfig,
    "evaluate": EvaluateConfig,
}


# --- strict conversion ----------------------------------------------------------


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
        raise ParamsError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__} {value!r}")
    return value


def _within(value: float, interval: str) -> bool:
    """Whether `value` lies in an interval written "[lo, hi)", "(lo, hi]"... ("inf" for no bound)."""
    left, lo, hi, right = re.fullmatch(r"([\[(])(\S+), (\S+)([\])])", interval).groups()
    low, high = float(lo), float(hi)
    return (value >= low if left == "[" else value > low) and (value <= high if right == "]" else value < high)


def check_value(value: Any, meta: typing.Mapping, key: str) -> None:
    """Refuse a value outside what its field's metadata declares (see "what a value may be"), naming the key."""
    if value is None:
        return
    if "range" in meta and isinstance(value, tuple) and not _within(len(value), meta["range"]):
        raise ParamsError(f"{key}: {len(value)} item(s); expected a number of items in {meta['range']}")
    if "range" in meta and not isinstance(value, tuple) and not _within(value, meta["range"]):
        kind = "an integer" if isinstance(value, int) else "a number"
        raise ParamsError(f"{key} = {value!r}: expected {kind} in {meta['range']}")
    if "multiple_of" in meta and value % meta["multiple_of"]:
        raise ParamsError(f"{key} = {value!r}: expected a multiple of {meta['multiple_of']}")
    if "choices" in meta and value not in meta["choices"]:
        raise ParamsError(f"{key} = {value!r}: expected one of {', '.join(map(repr, meta['choices']))}")
    if "format" in meta:
        matches, expected = FORMATS[meta["format"]]
        if not matches(value):
            raise ParamsError(f"{key} = {value!r}: expected {expected}")


def check_relations(obj: Any, key: str) -> None:
    """The rules between fields of one section."""
    if isinstance(obj, DataConfig) and obj.src_lang == obj.tgt_lang:
        raise ParamsError(f"{key}.tgt_lang = {obj.tgt_lang!r}: expected a language other than {key}.src_lang")
    if isinstance(obj, ModelConfig):
        try:
            obj.check_relations()
        except ValueError as e:
            raise ParamsError(str(e)) from None


def _to_dataclass(raw: Any, cls: type[T], key: str) -> T:
    if not isinstance(raw, dict):
        raise ParamsError(f"{key}: expected a mapping of {cls.__name__} fields, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ParamsError(f"{key}: unknown key(s) {', '.join(f'{key}.{u}' for u in unknown)}; expected {names}")
    missing = [f.name for f in fields if f.name not in raw and f.default is dataclasses.MISSING  # a default makes a
               and f.default_factory is dataclasses.MISSING]  # key optional
    if missing:
        raise ParamsError(f"{key}: missing key(s) {', '.join(f'{key}.{m}' for m in missing)}")
    values = {}
    for f in fields:
        if f.name not in raw:
            continue
        values[f.name] = _convert(raw[f.name], hints[f.name], f"{key}.{f.name}")
        check_value(values[f.name], f.metadata, f"{key}.{f.name}")
    obj = cls(**values)
    check_relations(obj, key)
    return obj


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
    """Load one section of a params file into its frozen dataclass, once the rules between its sections hold."""
    raw = read_yaml(path)
    try:
        loaded = parse(raw, section, cls)
        if section in RULED:  # the rules between the sections the file holds: from batch (train) on, each stage
            contradictions({name: parse(raw, name, SECTIONS[name]) for name in RULED if name in raw}, "", stage=True)
        return loaded
    except ParamsError as e:
        raise ParamsError(f"{path}: {str(e).removeprefix(': ')}") from None


def load_all(path: str | Path) -> dict[str, Any]:
    """Load and validate every section, and the rules between sections; unknown sections are an error too."""
    raw = read_yaml(path)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ParamsError(f"{path}: unknown section(s) {unknown}; expected {list(SECTIONS)}")
    sections = {name: load(path, name, cls) for name, cls in SECTIONS.items()}
    contradictions(sections, path)  # and the rules a stage leaves to others (pipeline/core/checks.py)
    return sections


HEADER = ("# Composed from conf/ (the comments and paper citations live there):\n"
          "#   python -m pipeline.core.config --compose params.yaml\n")
USAGE = """usage: python -m pipeline.core.config [PARAMS]                     check a params file (default params.yaml)
       python -m pipeline.core.config --compose PARAMS [OVERRIDE ...]  compose conf/ into PARAMS, then check it"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv and argv[0] == "--compose":
        path, overrides = argv[1], argv[2:]
        from pipeline.core.files import write_text

        write_text(path, HEADER + yaml.safe_dump(compose(overrides), sort_keys=False))
    path = argv[1] if argv and argv[0] == "--compose" else (argv[0] if argv else "params.yaml")
    load_all(path)
    print(f"{path}: OK ({', '.join(SECTIONS)})")


if __name__ == "__main__":
    from pipeline.core import cli

    cli.run(main)
