"""Hypotheses and references of two splits, and the evaluate stage run over them: what the scoring tests share."""

from __future__ import annotations

from pathlib import Path

import yaml

from stages import evaluate
from tests.train_fixtures import ROOT

REFS = {
    "test": ["Ein Mann fährt mit seinem Mountain-Bike über einen Feldweg.",
             "Zwei Kinder spielen im Garten mit einem roten Ball.",
             "Eine Frau liest die Süddeutsche Zeitung im Café \"Zur Post\".",
             "Der Hals-Nasen-Ohren-Arzt kommt um 8 Uhr & geht um 17 Uhr."],
    "valid": ["Ein Hund springt über den Zaun.", "Die E-Mail-Adresse ist falsch."],
}

HYPS = {
    "test": ["Ein Mann fährt mit dem Mountain-Bike auf einem Feldweg.",
             "Zwei Kinder spielen mit einem roten Ball im Garten.",
             "Eine Frau liest Zeitung in einem Café.",
             "Der Hals-Nasen-Arzt kommt um 8 Uhr und geht um 17 Uhr."],
    "valid": ["Ein Hund springt über einen Zaun.", "Die E-Mail ist falsch."],
}

def write_split_files(tmp_path: Path, hyps: dict, refs: dict) -> tuple[Path, Path]:
    translations, raw = tmp_path / "translations", tmp_path / "raw"
    for directory, texts in ((translations, hyps), (raw, refs)):
        directory.mkdir(exist_ok=True)
        for split, lines in texts.items():
            (directory / f"{split}.de").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return translations, raw

def run(tmp_path: Path, hyps: dict = HYPS, refs: dict = REFS) -> Path:
    translations, raw = write_split_files(tmp_path, hyps, refs)
    data = yaml.safe_load((ROOT / "params.yaml").read_text())["data"] | {"tgt_lang": "de"}
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"evaluate": {"tokenize": "13a"}, "data": data}))
    metrics = tmp_path / "metrics" / "eval.json"
    evaluate.main(["--translations", str(translations), "--raw", str(raw), "--metrics", str(metrics),
                   "--params", str(params)])
    return metrics
