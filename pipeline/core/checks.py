"""The rules between params, checked before any stage runs: contradictions refused with one line naming both keys.

    python -m pipeline.core.config params.yaml     # every section, then these rules (load_all)
    check_file(params)                             # what each stage checks first (cli.start), on the sections present

Each rule is one that a stage would otherwise refuse only once it runs, after the stages before it have run:
train.keep_checkpoints below average.last_n, compile_scope step with R-Drop, translate.engine ctranslate2 without an
export or with the project engine's translate.precision.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from pipeline.core.config import SECTIONS, ParamsError, compose, load_all, parse, read_yaml

HEADER = ("# Composed from conf/ (the comments and paper citations live there):\n"
          "#   python -m pipeline.core.config --compose params.yaml\n")
USAGE = """usage: python -m pipeline.core.config [PARAMS]                     check a params file (default params.yaml)
       python -m pipeline.core.config --compose PARAMS [OVERRIDE ...]  compose conf/ into PARAMS, then check it"""
RULED = ("train", "average", "export", "translate")  # the sections the rules read


def translate_engine(translate) -> None:
    """translate.precision is the project engine's: with the ctranslate2 engine, export.quantization says the type."""
    if translate.engine == "ctranslate2" and translate.precision != "auto":
        raise ParamsError(f"translate.precision = {translate.precision!r} sets the project engine's weights, and "
                          "translate.engine = ctranslate2 computes in export.quantization's type: set "
                          "translate.precision=auto (or translate.engine=project)")


def contradictions(sections: dict, path: str | Path) -> None:
    """Refuse params that contradict each other (`sections`: {name: dataclass}, those present)."""
    train, average, export, translate = (sections.get(name) for name in RULED)
    try:
        # Checked here, not by a stage: the train stage reading average.last_n would re-run training when it changes.
        if train and average and train.keep_checkpoints < average.last_n:
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


def check_file(path: str | Path) -> None:
    """The rules on a params file's sections that are present (a stage's start); a missing file is the stage's to
    report."""
    if not Path(path).is_file():
        return
    raw = read_yaml(path)
    try:
        sections = {name: parse(raw, name, SECTIONS[name]) for name in RULED if name in raw}
    except ParamsError as e:
        raise ParamsError(f"{path}: {e}") from None
    contradictions(sections, path)


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
