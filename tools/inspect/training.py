"""The views of the training outputs: the checkpoints (data/checkpoints) and the averaged model (data/model)."""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.core import config
from pipeline.weights.averaging import AverageError, select_checkpoints
from pipeline.weights.checkpoint import is_complete, step_files
from pipeline.weights.fingerprint import changed_files, code_fingerprint, code_hash
from pipeline.core.config import AverageConfig
from tools.inspect.common import InspectError, Options, params_or_reason, read_json, shown, table

log = logging.getLogger(__name__)


def read_payload(path: Path) -> dict:
    """A checkpoint's dict, memory-mapped (weights_only, on the CPU): its header costs no copy of the weights."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many kinds for a truncated or foreign file, with long messages
        raise InspectError(f"{shown(path)}: cannot load ({type(e).__name__}: {str(e).strip()[:80]}...)") from None
    if not isinstance(payload, dict) or "model" not in payload:
        raise InspectError(f"{shown(path)}: expected a dict with 'model' (a checkpoint of the train or average stage)")
    return payload


def clock(seconds: float) -> str:
    """h:mm:ss."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def code_column(payload: dict, current: dict[str, str]) -> list[str]:
    """The checkpoint's code fingerprint (first characters) and the files whose code differs from `current`."""
    code = payload.get("code")
    if code is None:
        return ["-", "unknown (none recorded)"]
    changed = changed_files(code, current)
    differs = ", ".join(changed[:2]) + (f" +{len(changed) - 2} more" if len(changed) > 2 else "")
    return [code_hash(code)[:8], f"differs: {differs}" if changed else "same"]


def checkpoint_row(step: int, path: Path, current: dict[str, str]) -> tuple[list, str | None]:
    """The table row of one checkpoint (all but the averaged column), and what is wrong with it, if anything."""
    problem, size = is_complete(path), f"{path.stat().st_size / 2**20:.1f}"
    try:
        payload = read_payload(path)
    except InspectError as e:
        problem = problem or str(e).removeprefix(f"{shown(path)}: ")
        return [step, "-", "-", "-", size, "-", "-", "-", f"unreadable: {problem}"], problem
    if problem is None and payload.get("step") != step:
        problem = f"its payload says step {payload.get('step')}"
    ppl = (payload.get("progress") or {}).get("valid", {}).get("valid_ppl")
    row = [step, clock(payload.get("elapsed_seconds", 0.0)), f"{payload.get('train_tokens', 0):,}",
           "-" if ppl is None else f"{ppl:.2f}", size, str(payload.get("params_hash"))[:8],
           *code_column(payload, current), problem or "sealed"]
    return row, problem


def averaged_by(path: Path, params: Path) -> tuple[list[Path], str]:
    """The checkpoints the average stage would take (average.last_n of `params`), and a line saying so."""
    cfg, why = params_or_reason(lambda: config.load(params, "average", AverageConfig))
    if cfg is None:
        return [], f"the average stage would take: unknown, params unreadable ({why})"
    logging.disable(logging.WARNING)  # select_checkpoints warns about each unsealed file: the table shows them
    try:
        chosen = select_checkpoints(path, cfg.last_n)
    except AverageError as e:
        return [], f"the average stage would fail: {e}"
    finally:
        logging.disable(logging.NOTSET)
    steps = ", ".join(p.name for p in chosen)
    return chosen, f"the average stage would take the last {cfg.last_n} complete ({shown(params)}): {steps}"


def show_checkpoints(path: Path, opts: Options) -> None:
    """Each checkpoint's step, time, tokens, validation perplexity, seal, and which ones `average` would take."""
    found = step_files(path)
    if not found:
        raise FileNotFoundError(f"{shown(path)}: no step_XXXXXXXX.pt files; expected the train stage's checkpoints")
    log.info("checking the sha256 of %d checkpoint(s)", len(found))
    chosen, line = averaged_by(path, opts.params)
    rows, problems, current = [], [], code_fingerprint("stages.train")
    for step, file in found:
        row, problem = checkpoint_row(step, file, current)
        rows.append([*row[:-1], "yes" if file in chosen else "", row[-1]])
        problems += [f"{shown(file)}: {problem}"] if problem else []
    print(f"checkpoints {shown(path)}: {len(found)} file(s)\n")
    print(table(["step", "wall time", "train tokens", "valid ppl", "MiB", "params", "code", "vs current code",
                 "averaged", "status"], rows))
    print(f"\n{line}")
    print("(valid ppl: the last validation before the checkpoint, every train.eval_every steps; params: the first "
          "characters of params_hash; code: of the fingerprint of the code that trained it, now "
          f"{code_hash(current)[:8]}; both must agree for `average`, and a checkpoint of other code is not resumed)")
    if problems:
        more = f" ({len(problems) - 1} more in the table)" if len(problems) > 1 else ""
        raise InspectError(f"{problems[0]}; expected a sealed checkpoint that loads{more}")


def component(name: str) -> tuple[str, str]:
    """('encoder layer 0', 'self_attn') for 'encoder.0.self_attn.w_qkv.weight'; ('embedding', '') for the rest."""
    parts = name.split(".")
    if parts[0] in ("encoder", "decoder") and len(parts) > 2 and parts[1].isdigit():
        return f"{parts[0]} layer {parts[1]}", "norms" if parts[2].startswith("norm") else parts[2]
    return parts[0], ""


def count_parameters(state: dict[str, torch.Tensor]) -> list[list]:
    """Rows of (component, parameters, share, its parts) in the state dict's order."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, tensor in state.items():
        group, part = component(name)
        totals[group][part] += tensor.numel()
    grand = sum(sum(parts.values()) for parts in totals.values())
    return [[group, sum(parts.values()), f"{sum(parts.values()) / grand:.1%}",
             ", ".join(f"{part} {n:,}" for part, n in parts.items() if part)] for group, parts in totals.items()]


def show_model(path: Path, opts: Options) -> None:
    """The averaged model: its config, the checkpoints it averages, and parameters by component."""
    model_path = path / "model.pt"
    if not model_path.is_file():
        raise FileNotFoundError(f"{shown(model_path)}: missing; expected the averaged model (average stage)")
    payload = read_payload(model_path)
    missing = [key for key in ("model_config", "vocab_size") if key not in payload]
    if missing:
        raise InspectError(f"{shown(model_path)}: no {', '.join(missing)}; expected the average stage's model.pt")
    averaged = read_json(path / "averaged.json", "the steps and checkpoint files the average stage averaged")
    state = payload["model"]
    print(f"model {shown(model_path)}: {sum(t.numel() for t in state.values()):,} parameters "
          f"({', '.join(sorted({str(t.dtype).removeprefix('torch.') for t in state.values()}))}), "
          f"{model_path.stat().st_size / 2**20:.1f} MiB")
    print(f"built from: vocab_size {payload['vocab_size']}, "
          + ", ".join(f"{key} {value}" for key, value in payload["model_config"].items()))
    print(f"averages {len(averaged.get('checkpoints', []))} checkpoint(s) ({shown(path / 'averaged.json')}): "
          f"{', '.join(averaged.get('checkpoints', []))}; steps {averaged.get('steps')}")
    if payload.get("steps") is not None and payload.get("steps") != averaged.get("steps"):
        raise InspectError(f"{shown(model_path)} holds steps {payload['steps']} but averaged.json says "
                           f"{averaged.get('steps')}: expected one average run to have written both")
    print("\nparameters by component (the output projection shares the embedding matrix when no tensor of its own "
          "is listed):")
    print(table(["component", "parameters", "share", "parts"], count_parameters(state)))
