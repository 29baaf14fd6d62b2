"""A tiny translation setup for tests: raw files, the real tokenize stage on them, a random tiny model.

    raw, tokenized = make_corpus(tmp_path)      # data/raw and data/tokenized (sentencepiece, 60 pieces)
    model_dir = save_model(tmp_path / "model", tokenized)

and two autouse fixtures to import into a test module: `shared_store` (one
sqlite MLflow store per module instead of one per test: creating one takes
seconds) and `one_thread` (torch on one thread: a tiny model gains nothing
from more, and on a busy machine threads waiting for each other cost 10x).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import yaml

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.core.config import TokenizeConfig
from pipeline.corpus.formats import read_meta
from stages.tokenize import tokenize

MODEL_CONFIG = dict(n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.1,
                    positional_encoding="sinusoidal", max_positions=128)
TRANSLATE = dict(beam_size=3, length_penalty=0.6, max_len_a=1.0, max_len_b=4, max_tokens=40)

SUBJECTS_EN = ["A man", "A woman", "Two dogs", "The child", "A girl", "An old man"]
VERBS_EN = ["rides", "watches", "paints", "carries", "finds"]
OBJECTS_EN = ["a bike.", "the red ball.", "a small boat.", "two blue chairs.", "the house on the hill."]
SUBJECTS_DE = ["Ein Mann", "Eine Frau", "Zwei Hunde", "Das Kind", "Ein Mädchen", "Ein alter Mann"]
VERBS_DE = ["fährt", "beobachtet", "malt", "trägt", "findet"]
OBJECTS_DE = ["ein Fahrrad.", "den roten Ball.", "ein kleines Boot.", "zwei blaue Stühle.", "das Haus am Hügel."]

# Test sources of very different lengths, and an empty line (kept: test is never filtered).
TEST_EN = ["A man rides a bike.", "", "Two dogs watches the house on the hill and a girl paints two blue chairs.",
           "The child finds the red ball.", "An old man carries a small boat.", "A girl."]
VALID_EN = ["A woman paints a bike.", "Two dogs rides the red ball and the child finds a small boat."]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """The tracking URI of a sqlite MLflow store shared by a test module."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def shared_store(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for stages that size their thread pool, and subprocesses
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sentence_pairs() -> list[tuple[str, str]]:
    """Every subject x verb x object in both languages (150 pairs)."""
    triples = itertools.product(range(len(SUBJECTS_EN)), range(len(VERBS_EN)), range(len(OBJECTS_EN)))
    return [(f"{SUBJECTS_EN[s]} {VERBS_EN[v]} {OBJECTS_EN[o]}", f"{SUBJECTS_DE[s]} {VERBS_DE[v]} {OBJECTS_DE[o]}")
            for s, v, o in triples]


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def make_corpus(root: Path) -> tuple[Path, Path]:
    """root/raw with en-de train/valid/test and root/tokenized made by the tokenize stage itself."""
    return tokenized_corpus(root / "raw", root / "tokenized")


def tokenized_corpus(raw: Path, tokenized: Path, extra_pairs: tuple = (), metrics: Path | None = None) -> tuple[Path, Path]:
    """`raw` with en-de train (sentence_pairs() + extra_pairs)/valid/test, and `tokenized` by the tokenize stage."""
    pairs = [*sentence_pairs(), *extra_pairs]
    write_lines(raw / "train.en", [en for en, _ in pairs])
    write_lines(raw / "train.de", [de for _, de in pairs])
    for split, sources in (("test", TEST_EN), ("valid", VALID_EN)):
        write_lines(raw / f"{split}.en", sources)
        write_lines(raw / f"{split}.de", [f"Referenz {i}." for i in range(len(sources))])
    cfg = TokenizeConfig(model_type="bpe", vocab_size=60, character_coverage=1.0, input_sentence_size=0,
                         max_len=64, max_len_ratio=3.0, seed=1)
    tokenize(raw, tokenized, ("en", "de"), cfg, metrics)
    return raw, tokenized


def save_model(model_dir: Path, tokenized: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny model written as the average stage writes data/model/model.pt."""
    torch.manual_seed(seed)
    vocab_size = read_meta(tokenized)["vocab_size"]
    model = Transformer(ModelConfig(**MODEL_CONFIG), vocab_size)
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "model_config": MODEL_CONFIG, "vocab_size": vocab_size,
                "steps": [1], "params_hash": "test"}, model_dir / "model.pt")
    return model_dir


def write_params(path: Path, **sections: dict) -> Path:
    """A params file holding just the given sections (the translate section by default)."""
    path.write_text(yaml.safe_dump({"translate": TRANSLATE, **sections}), encoding="utf-8")
    return path
