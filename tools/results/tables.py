"""The published tables, generated from the record, and the marked places in README.md and docs/ they fill.

Each table is one block, between `<!-- results:NAME -->` and `<!-- /results:NAME -->` in a file of PLACES:

    headline   the default per machine: seeds, test sacreBLEU and lc.norm.tok, valid BLEU (mean ± sd), the
               `make run` time of each timed run, and its ratio to the earlier default's in the same sitting
    presets    every recipe that is not a lever, per machine, the same figures and training FLOPs
    runs       every run of those recipes, a row each, with its commit and source
    times      every time ratio: two runs of one sitting, named, their walls and the ratio
    target     one sentence: the sittings where the default's `make run` meets its TARGET against the earlier
               default's and those where it misses it, each with its ratio
    levers     the levers tried against a baseline recipe: valid BLEU change seed by seed (paired with the
               baseline's run of the same seed on the same machine), time ratio in one sitting, commit, command

sd is the sample standard deviation (n - 1) and is left out of a group of one run.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Callable

EARLIER = "the earlier default"  # the recipe every time ratio of the headline is taken against
DEFAULT = "the default"
TARGET = 1.25  # the most the default's `make run` may take against the earlier default's, in one sitting
PLACES = {"README.md": ("target", "headline", "presets"), "docs/results.md": ("runs", "times", "target", "levers")}
BLOCK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def spread(values: list[float]) -> str:
    """`mean ± sd` over seeds (2 decimals; the mean alone for one value)."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s"


def machine(line: dict) -> str:
    """A run's machine as the tables name it: threads, the CPU's maker and class (or the GPU), an emulation."""
    m = line["machine"]
    if m["class"] == "GPU":
        return f"{m['gpu']}"
    cpu = m["cpu"] or "a CPU"
    maker = "Intel Xeon" if "Xeon" in cpu else "AMD EPYC" if "EPYC" in cpu else cpu
    cap = line["emulated"] or ""
    what = f"{maker}, {m['class']}" + (" (emulated: thread cap)" if cap.startswith("thread cap") else
                                       " (emulated: ISA capped)" if cap else "")
    threads = m["threads"]
    return f"{threads} thread{'s' if threads > 1 else ''}, {what}" if threads else what


def published(line: dict) -> bool:
    """A run of a recipe (not a lever) with a test score or a `make run` time: what the runs and presets tables show
    (a baseline run scored on validation only appears in the levers table, through its levers)."""
    return line["baseline"] is None and (line["test"].get("bleu") is not None or "run" in line["wall_s"])


def _groups(lines: list[dict], keep: Callable[[dict], bool]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for line in lines:
        if keep(line):
            out.setdefault((line["recipe"], machine(line)), []).append(line)
    return out


def _scores(runs: list[dict], split: str, name: str) -> str:
    """mean ± sd over seeds: a seed's first run with the score counts, a rerun of it (a timing) does not."""
    first = {}
    for r in runs:
        if r[split].get(name) is not None:
            first.setdefault(r["seed"], r[split][name])
    values = list(first.values())
    return spread(values) if values else "-"


def pairs(lines: list[dict], recipe: str, against: str, wall: str = "run") -> list[tuple[dict, dict]]:
    """(run of `recipe`, run of `against`) of one sitting, on one machine, both timed by `wall`."""
    found = []
    for a in lines:
        for b in lines:
            if (a["recipe"] == recipe and b["recipe"] == against and a["sitting"] and a["sitting"] == b["sitting"]
                    and machine(a) == machine(b) and wall in a["wall_s"] and wall in b["wall_s"]
                    and (a["baseline"] is None or a["seed"] == b["seed"])):
                found.append((a, b))
    return found


def _ratio(pair: tuple[dict, dict], wall: str = "run") -> str:
    a, b = pair
    return f"{a['wall_s'][wall] / b['wall_s'][wall]:.2f}x ({a['id']} / {b['id']})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def _seeds(runs: list[dict]) -> str:
    """How many seeds were scored (a run timed only, without scores, adds none)."""
    return str(len({r["seed"] for r in runs if r["test"].get("bleu") is not None or r["valid"].get("bleu") is not None}))


def _timed(runs: list[dict]) -> str:
    timed = [r for r in runs if "run" in r["wall_s"]]
    return "; ".join(f"{minutes(r['wall_s']['run'])} ({r['id']})" for r in timed) or "-"


def headline(lines: list[dict]) -> str:
    rows = []
    for (_, where), runs in _groups(lines, lambda l: l["recipe"] == DEFAULT and published(l)).items():
        ratios = [_ratio(p) for p in pairs(lines, DEFAULT, EARLIER) if machine(p[0]) == where]
        rows.append([where, _seeds(runs), _scores(runs, "test", "bleu"), _scores(runs, "test", "lc_norm_tok"),
                     _scores(runs, "valid", "bleu"), _timed(runs), "; ".join(ratios) or "-"])
    return _table(["machine", "seeds", "test2016 sacreBLEU", "lc.norm.tok", "valid BLEU", "`make run` / `dvc repro`",
                   f"time against {EARLIER}, one sitting"], rows)


def presets(lines: list[dict]) -> str:
    rows = []
    for (recipe, where), runs in _groups(lines, lambda l: published(l) and l["recipe"] != EARLIER).items():
        flops = sorted({f"{r['flops']:.1e}".replace("e+", "e") for r in runs if r["flops"]})
        cut = " (the safety stop)" if any(r["stopped_by"] == "max_minutes" for r in runs) else ""
        rows.append([recipe, where, _seeds(runs), f"{runs[0]['steps']}{cut}", _scores(runs, "test", "bleu"),
                     _scores(runs, "test", "lc_norm_tok"), _scores(runs, "test", "bleu_tokenized"),
                     _scores(runs, "valid", "bleu"), ", ".join(flops) or "-"])
    return _table(["recipe", "machine", "seeds", "steps", "sacreBLEU", "lc.norm.tok", "tokenized BLEU", "valid BLEU",
                   "training FLOPs"], rows)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def runs(lines: list[dict]) -> str:
    rows = []
    for r in lines:
        if not published(r):
            continue
        source = "transcribed: " + r["transcribed"]["source"] if r["transcribed"] else "recorded"
        rows.append([r["id"], r["recipe"], machine(r), str(r["seed"]), r["commit"][:7], f"`{r['command']}`",
                     r["date"], *(_number(r["test"].get(k)) for k in ("bleu", "lc_norm_tok", "chrf")),
                     _number(r["valid"].get("bleu")), _number(r["valid"].get("ppl")),
                     minutes(r["wall_s"]["run"]) if "run" in r["wall_s"] else "-", source])
    return _table(["run", "recipe", "machine", "seed", "commit", "command", "date", "sacreBLEU", "lc.norm.tok", "chrF",
                   "valid BLEU", "valid ppl", "time", "source"], rows)


def times(lines: list[dict]) -> str:
    rows = []
    for recipe in dict.fromkeys(l["recipe"] for l in lines if l["recipe"] != EARLIER and l["baseline"] is None):
        for a, b in pairs(lines, recipe, EARLIER):
            rows.append([a["sitting"], machine(a), f"{recipe}: {a['id']}, {minutes(a['wall_s']['run'])}",
                         f"{b['id']} ({b['commit'][:7]}), {minutes(b['wall_s']['run'])}",
                         f"**{a['wall_s']['run'] / b['wall_s']['run']:.2f}x**"])
    return _table(["sitting", "machine", "run", f"{EARLIER}'s run", "ratio"], rows)


def target(lines: list[dict]) -> str:
    """Where the default's time meets TARGET and where it misses it, sitting by sitting (a line of prose)."""
    ratios = [(a, a["wall_s"]["run"] / b["wall_s"]["run"]) for a, b in pairs(lines, DEFAULT, EARLIER)]

    def named(found: list[tuple[dict, float]]) -> str:
        return "; ".join(f"{machine(a)}, {x:.2f}x ({a['sitting']})" for a, x in found) or "none"

    missed = [(a, x) for a, x in ratios if round(x, 2) > TARGET]
    met = [(a, x) for a, x in ratios if round(x, 2) <= TARGET]
    return (f"The default's time target, at most {TARGET}x the earlier default's in one sitting: missed in "
            f"{len(missed)} of {len(ratios)} sittings ({named(missed)}), met in {named(met)}.\n")


def _signed(value: float) -> str:
    return f"{round(value, 2) + 0.0:+.2f}"  # + 0.0: no "-0.00"


def _any_seed(line: dict) -> str:
    """A lever's command with its seed written as N (each seed ran it)."""
    return line["command"].replace(f"train.seed={line['seed']} batch.seed={line['seed']}", "train.seed=N batch.seed=N")


def levers(lines: list[dict]) -> str:
    rows = []
    tried_by: dict[tuple[str, str, str], list[dict]] = {}
    for line in lines:  # a lever tried against two baselines is two rows
        if line["baseline"] is not None:
            tried_by.setdefault((line["recipe"], line["baseline"], machine(line)), []).append(line)
    for (lever, _, where), tried in tried_by.items():
        changes, ratios = [], []
        for run in sorted(tried, key=lambda r: r["seed"]):
            base = [b for b in lines if b["recipe"] == run["baseline"] and b["seed"] == run["seed"]
                    and machine(b) == where]
            base.sort(key=lambda b: b["sitting"] != run["sitting"])  # the same sitting's run first
            if base and run["valid"].get("bleu") is not None and base[0]["valid"].get("bleu") is not None:
                changes.append(run["valid"]["bleu"] - base[0]["valid"]["bleu"])
            if base and run["sitting"] and base[0]["sitting"] == run["sitting"] and all(
                    "train" in x["wall_s"] for x in (run, base[0])):
                ratios.append(run["wall_s"]["train"] / base[0]["wall_s"]["train"])
        seeds = " / ".join(str(r["seed"]) for r in sorted(tried, key=lambda r: r["seed"]))
        change = (" / ".join(_signed(c) for c in changes) + (f" (mean {_signed(statistics.mean(changes))})"
                                                               if len(changes) > 1 else "")) if changes else "-"
        ratio = " / ".join(f"{x:.2f}x" for x in ratios) or "-"
        cut = [r for r in tried if r["stopped_by"] == "max_minutes"]
        name = lever + "".join(f" (seed {r['seed']} ended by the safety stop at step {r['steps']})" for r in cut)
        rows.append([name, f"{tried[0]['baseline']}; {where}", seeds, change, ratio,
                     ", ".join(sorted({r["commit"][:7] for r in tried})), f"`{_any_seed(tried[0])}`"])
    return _table(["lever", "against; machine", "seeds", "valid BLEU change", "training time ratio, one sitting",
                   "commit", "command"], rows)


RENDER = {"headline": headline, "presets": presets, "runs": runs, "times": times, "target": target, "levers": levers}


def fill(text: str, lines: list[dict]) -> str:
    """`text` with every marked block rewritten from the record."""
    return BLOCK.sub(lambda m: m.group(1) + RENDER[m.group(2)](lines) + m.group(4), text)


def differences(root: Path, lines: list[dict]) -> list[str]:
    """Each marked place under `root` whose text is not what the record gives, or that is missing."""
    found = []
    for rel, names in PLACES.items():
        text = (root / rel).read_text(encoding="utf-8")
        blocks = {m.group(2): m.group(3) for m in BLOCK.finditer(text)}
        for name in names:
            if name not in blocks:
                found.append(f"{rel}: no <!-- results:{name} --> block")
            elif blocks[name] != RENDER[name](lines):
                found.append(f"{rel}: the {name} table differs from what the record gives")
    return found
