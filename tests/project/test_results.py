"""The published figures are the record's: README.md's and docs/results.md's marked tables against results/runs.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.errors import PipelineError
from tools.results import main, store, tables

ROOT = Path(__file__).resolve().parents[2]


def test_every_marked_table_is_what_the_record_gives():
    assert tables.differences(ROOT, store.read(ROOT / store.RECORD)) == []


def test_a_figure_edited_by_hand_is_caught(tmp_path):
    for rel in tables.PLACES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text(encoding="utf-8"), encoding="utf-8")
    readme = tmp_path / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert "40.17 ± 0.36" in text
    readme.write_text(text.replace("40.17 ± 0.36", "40.71 ± 0.36", 1), encoding="utf-8")
    assert main.main(["tables", "--root", str(tmp_path), "--check"]) == 1
    assert main.main(["tables", "--root", str(tmp_path)]) == 0  # rewritten from the record: right again
    assert main.main(["tables", "--root", str(tmp_path), "--check"]) == 0 and readme.read_text() == text


def test_every_line_names_its_source_and_every_headline_machine_has_a_sitting():
    lines = store.read(ROOT / store.RECORD)
    assert all(line["transcribed"] is None or "issue stop" in line["transcribed"]["source"] for line in lines)
    defaults = {tables.machine(l) for l in lines if l["recipe"] == tables.DEFAULT}
    paired = {tables.machine(a) for a, _ in tables.pairs(lines, tables.DEFAULT, tables.EARLIER)}
    assert defaults == paired  # every machine the headline names has its time ratio from one sitting


def test_means_spreads_and_ratios_are_computed_from_the_lines():
    lines = [json.loads(l) for l in (ROOT / store.RECORD).read_text().splitlines()]
    xeon = [l for l in lines if l["recipe"] == tables.DEFAULT and l["machine"]["class"] == "AMX" and l["test"]["bleu"]]
    assert tables.spread([l["test"]["bleu"] for l in xeon]) == "40.17 ± 0.36"
    for line in xeon:
        line["test"]["bleu"] += 1.0
    assert "41.17 ± 0.36" in tables.headline(lines)
    new, old = next(p for p in tables.pairs(lines, tables.DEFAULT, tables.EARLIER) if p[0]["id"] == "xeon-slow-new")
    assert f"{new['wall_s']['run'] / old['wall_s']['run']:.2f}x (xeon-slow-new / xeon-slow-old)" in tables.headline(lines)
    ratio = f"2 threads, Intel Xeon, AMX, {new['wall_s']['run'] / old['wall_s']['run']:.2f}x (xeon-2026-11-29)"
    said = tables.target(lines)
    assert ratio in said.split(", met in ")[0] and ratio not in said.split(", met in ")[1]  # above 1.25x: missed
    new["wall_s"]["run"] = old["wall_s"]["run"] * 1.2
    assert "2 threads, Intel Xeon, AMX, 1.20x (xeon-2026-11-29)" in tables.target(lines).split(", met in ")[1]
    old["sitting"] = "another"  # runs of two sittings are never paired
    assert "xeon-slow-old" not in tables.headline(lines) and "xeon-2026-11-29" not in tables.target(lines)


def test_a_run_ended_by_the_safety_stop_says_so_where_its_scores_are_published():
    lines = [json.loads(l) for l in (ROOT / store.RECORD).read_text().splitlines()]
    xeon = [l for l in lines if l["recipe"] == tables.DEFAULT and l["machine"]["class"] == "AMX"]
    assert "| 4600 |" in tables.presets(xeon) and "safety stop" not in tables.presets(xeon)
    xeon[0].update(stopped_by="max_minutes", steps=3100)
    assert "| 3100 (the safety stop) |" in tables.presets(xeon)


@pytest.mark.parametrize("edit, found", [(lambda l: l.pop("commit"), "missing commit"),
                                         (lambda l: l.update(date="30/11/2026"), "date: expected YYYY-MM-DD"),
                                         (lambda l: l.update(stopped_by="tired"), "stopped_by: expected one of"),
                                         (lambda l: l["machine"].update({"class": "fast"}), "machine.class")])
def test_a_bad_record_line_fails_naming_its_line_and_key(tmp_path, edit, found):
    lines = (ROOT / store.RECORD).read_text().splitlines()
    bad = json.loads(lines[1])
    edit(bad)
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(bad)]) + "\n")
    with pytest.raises(PipelineError, match=f"runs.jsonl:2: .*{found}"):
        store.read(path)
