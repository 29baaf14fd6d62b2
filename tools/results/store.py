"""results/runs.jsonl: what a line holds, reading it back checked, and appending a line atomically.

A line (one run), every key present, None where the run's records have no such figure:

    id             unique, short: what the tables name a run by
    sitting        runs made one after the other (or side by side) on one machine share it; time ratios are
                   taken only within one sitting. None: a run timed alone
    date           YYYY-MM-DD the run ended
    commit, clean  the commit of the code that ran, and whether its tree had no change but what the run wrote
    command        what ran it (`make run`, `dvc repro`, `dvc exp run -S ...`), with its environment
    preset         the experiment preset; recipe: what was run, as the tables name it ("the default", a
                   preset, a lever); baseline: for a lever, the recipe it is measured against (seed by seed)
    params_hash    of params.yaml as the run read it; seed: train.seed (= batch.seed)
    machine        {"cpu": model name, "class": a unit of pipeline/device/cpu.py (AVX2, AVX-512 BF16...) or GPU,
                    "threads", "gpu"}
    emulated       None, or how the machine was made to stand for another (a capped ISA, a thread cap)
    precision      how the steps computed (metrics/train.json's precision)
    wall_s         seconds: "run" (make run or dvc repro, `make install` apart) and one per stage timed
    steps, train_tokens, flops, stopped_by                              (metrics/train.json)
    valid, test    {"bleu", "lc_norm_tok", "chrf", ...} (metrics/eval.json; valid also "ppl")
    decode_sentences_per_s                                              (metrics/export.json)
    transcribed    None for a line `record` wrote; else {"source": the note that reported the figures, with
                   its commit, command, machine and date}
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.core.errors import PipelineError
from pipeline.core.files import write_text
from pipeline.device.cpu import UNITS

RECORD = Path("results") / "runs.jsonl"
CLASSES = (*UNITS, "GPU")
STOPS = ("max_steps", "max_minutes")
SCORES = ("bleu", "lc_norm_tok", "bleu_tokenized", "chrf", "ppl")
OPTIONAL = object()  # a field that may be None
FIELDS = {  # key -> the type of its value (None allowed where marked OPTIONAL)
    "id": str, "sitting": (str, OPTIONAL), "date": str, "commit": str, "clean": bool, "command": str,
    "preset": str, "recipe": str, "baseline": (str, OPTIONAL), "params_hash": (str, OPTIONAL), "seed": int,
    "machine": dict, "emulated": (str, OPTIONAL), "precision": str, "wall_s": dict, "steps": int,
    "train_tokens": (int, OPTIONAL), "flops": (float, OPTIONAL), "stopped_by": (str, OPTIONAL),
    "valid": dict, "test": dict, "decode_sentences_per_s": (float, OPTIONAL), "transcribed": (dict, OPTIONAL),
}
MACHINE = ("cpu", "class", "threads", "gpu")
MEND = "mend the line, or append it anew with `python -m tools.results record` in the run's repository"


def problems(line: dict) -> list[str]:
    """What is wrong with one record line (empty when nothing is)."""
    found = [f"missing {key}" for key in FIELDS if key not in line]
    found += [f"unknown key {key}" for key in line if key not in FIELDS]
    for key, kind in FIELDS.items():
        value = line.get(key)
        optional = isinstance(kind, tuple)
        kind = kind[0] if optional else kind
        if key not in line or (value is None and optional):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            found.append(f"{key}: expected {kind.__name__}, got {value!r}")
    if isinstance(line.get("date"), str) and not re.fullmatch(r"\d{4}-\d\d-\d\d", line["date"]):
        found.append(f"date: expected YYYY-MM-DD, got {line['date']!r}")
    machine = line.get("machine")
    if isinstance(machine, dict):
        found += [f"machine: missing {k}" for k in MACHINE if k not in machine]
        if machine.get("class") not in CLASSES:
            found.append(f"machine.class: expected one of {', '.join(CLASSES)}, got {machine.get('class')!r}")
    if line.get("stopped_by") not in (None, *STOPS):
        found.append(f"stopped_by: expected one of {', '.join(STOPS)}, got {line['stopped_by']!r}")
    for split in ("valid", "test"):
        for name, value in (line.get(split) or {}).items() if isinstance(line.get(split), dict) else ():
            if name not in SCORES or not (value is None or isinstance(value, (int, float))):
                found.append(f"{split}.{name}: expected one of {', '.join(SCORES)} with a number")
    transcribed = line.get("transcribed")
    if isinstance(transcribed, dict) and not isinstance(transcribed.get("source"), str):
        found.append("transcribed: expected {\"source\": the issue note, its commit, command, machine and date}")
    return found


def read(path: Path) -> list[dict]:
    """Every line of the record at `path`, checked: PipelineError naming the file, line and key otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PipelineError(f"{path}: no results record; append a run with `python -m tools.results record`") from None
    lines, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            raise PipelineError(f"{path}:{number}: not a JSON line ({e.msg}); {MEND}") from None
        wrong = problems(line) if isinstance(line, dict) else ["expected a JSON object"]
        if not wrong and line["id"] in seen:
            wrong = [f"id {line['id']!r} already used by an earlier line"]
        if wrong:
            raise PipelineError(f"{path}:{number}: {'; '.join(wrong)}; {MEND}")
        seen.add(line["id"])
        lines.append(line)
    return lines


def append(path: Path, line: dict) -> None:
    """Add `line` to the record at `path` (checked first; the file replaced whole, atomically)."""
    wrong = problems(line)
    earlier = read(path) if path.exists() else []
    if any(other["id"] == line["id"] for other in earlier):
        wrong.append(f"id {line['id']!r} already in the record")
    if wrong:
        raise PipelineError(f"{path}: the new line: {'; '.join(wrong)}")
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    write_text(path, old + json.dumps(line, sort_keys=False) + "\n")
