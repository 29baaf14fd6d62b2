"""The WMT14 presets' data stages run end to end on a tiny stand-in corpus at the official file layout.

No WMT data here: every archive a preset names is written with the members the
preset reads, filled with a few hundred aligned synthetic lines
(tests/fixtures/wmt_standin.py). Then download -> tokenize -> batch run on each preset's
composed params (tiny vocabulary), so the first user with the real files meets
no path that never ran. tests/rehearse.py (make rehearse) runs all eight stages
of the en-de base preset on a larger stand-in.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import urllib.parse
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import compose
from pipeline.corpus.formats import SPLITS
from stages import batch, download, tokenize
from tests.fixtures.files_server import FileServer
from tests.fixtures.wmt_standin import local_urls, stand_in

PRESETS = ["wmt14_en_de_base", "wmt14_en_fr_big"]  # en-de big reads the same files as en-de base
LINES = {"train": 150, "valid": 20, "test": 20}


def run_data_stages(root: Path, params: dict) -> dict[str, dict]:
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = ["--params", str(root / "params.yaml")]
    download.main(["--out", str(root / "raw"), "--metrics", str(root / "m" / "download.json"), *p])
    tokenize.main(["--raw", str(root / "raw"), "--out", str(root / "tokenized"), "--metrics",
                   str(root / "m" / "tokenize.json"), *p])
    batch.main(["--tokenized", str(root / "tokenized"), "--out", str(root / "batches"), "--metrics",
                str(root / "m" / "batch.json"), *p])
    return {stem: json.loads((root / "m" / f"{stem}.json").read_text()) for stem in ("download", "tokenize", "batch")}


@pytest.mark.parametrize("experiment", PRESETS)
def test_the_presets_data_stages_run_on_a_stand_in_at_the_official_layout(tmp_path, experiment):
    params = compose([f"experiment={experiment}", "tokenize.vocab_size=70"])
    www = tmp_path / "www"
    with FileServer(www) as server:
        pinned = stand_in(www, params["data"], LINES)
        params["data"] = local_urls(pinned, server)
        metrics = run_data_stages(tmp_path, params)
        archives = {urllib.parse.urlsplit(r.path).path for r in server.requests}
    names = {s["url"] for split in SPLITS for c in params["data"][split] for s in (c["src"], c["tgt"])}
    assert len(archives) == len(names)  # each archive fetched once for all its members
    data, d = params["data"], metrics["download"]
    for split in SPLITS:
        assert d[f"{split}_lines"] == LINES[split] * len(data[split])
        for corpus in data[split]:
            assert d[f"lines/{corpus['name']}"] == LINES[split]
    raw = tmp_path / "raw"
    src, tgt = data["src_lang"], data["tgt_lang"]
    for lang in (src, tgt):
        test_side = (raw / f"test.{lang}").read_text().splitlines()
        assert len(test_side) == LINES["test"] and not any("<seg" in line for line in test_side)  # SGML unwrapped
    assert metrics["tokenize"]["vocab_size"] == 70
    assert metrics["batch"]["num_batches"] >= 1 and metrics["batch"]["valid_num_batches"] >= 1
    assert not any(k.startswith("sha256_seen/") for k in d)  # every file was pinned


@pytest.mark.parametrize("experiment", PRESETS)
def test_the_presets_unpinned_files_are_each_named_by_the_download(tmp_path, monkeypatch, caplog, experiment):
    """The official URLs, through CORPUS_MIRROR (the stand-in's directory), with the presets' null sha256 kept."""
    params = compose([f"experiment={experiment}"])
    official = params["data"]
    pinned = stand_in(tmp_path / "mirror", official, LINES)
    data = copy.deepcopy(pinned)
    unpinned = []
    for split in SPLITS:
        for corpus, was in zip(data[split], official[split]):
            for side in ("src", "tgt"):
                if was[side]["sha256"] is None:
                    corpus[side]["sha256"] = None
                    unpinned.append((corpus["name"], side, f"{was[side]['url']} member {was[side]['member']}",
                                     pinned_sha(pinned, split, corpus["name"], side)))
    assert unpinned, "the preset pins every file now: drop this test's premise"
    params["data"] = data
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.setenv("CORPUS_MIRROR", str(tmp_path / "mirror"))
    with caplog.at_level(logging.WARNING):
        download.main(["--out", str(tmp_path / "raw"), "--metrics", str(tmp_path / "download.json"),
                       "--params", str(tmp_path / "params.yaml")])
    seen = json.loads((tmp_path / "download.json").read_text())
    for name, side, label, sha in unpinned:
        said = rf"sha256 NOT PINNED for {re.escape(label)} \(read from CORPUS_MIRROR copy [^)]+\): saw {sha}"
        assert re.search(said, caplog.text), (label, sha)
        assert seen[f"sha256_seen/{name}/{side}"] == sha
    assert len([k for k in seen if k.startswith("sha256_seen/")]) == len(unpinned)


def pinned_sha(data: dict, split: str, name: str, side: str) -> str:
    return next(c[side]["sha256"] for c in data[split] if c["name"] == name)
