"""A tiny trained model for the export tests: the translation fixtures' corpus learned for a few seconds.

    model_dir = trained_model(tmp_path / "model", tokenized, "rotary")    # written as the average stage writes it

A randomly initialised model almost never emits EOS, so every output would run to its length limit; a trained one
ends its outputs where it learned to, so greedy outputs of two engines are identical only if every weight is
mapped right.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.corpus.formats import BOS_ID, EOS_ID, PAD_ID, load_spm, read_meta
from tests.translation_fixtures import MODEL_CONFIG, sentence_pairs


def trained_model(model_dir: Path, tokenized: Path, positions: str, steps: int = 120, seed: int = 0,
                  **shape) -> Path:
    """Train the tiny model (full batch, Adam; `shape`: other model keys) on sentence_pairs() for `steps` steps
    (0: as initialised) and save it as data/model/model.pt."""
    torch.manual_seed(seed)
    vocab_size = read_meta(tokenized)["vocab_size"]
    cfg = {**MODEL_CONFIG, "dropout": 0.0, "positional_encoding": positions,
           **({"rotary_base": 100.0} if positions == "rotary" else {}), **shape}
    model = Transformer(ModelConfig(**cfg), vocab_size)
    sp = load_spm(tokenized, vocab_size)
    pairs = sentence_pairs()
    src = pad_sequence([torch.tensor(sp.encode(en) + [EOS_ID]) for en, _ in pairs], True, PAD_ID)
    tgt = [sp.encode(de) for _, de in pairs]
    tgt_in = pad_sequence([torch.tensor([BOS_ID, *t]) for t in tgt], True, PAD_ID)
    gold = pad_sequence([torch.tensor([*t, EOS_ID]) for t in tgt], True, PAD_ID)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(src, tgt_in).flatten(0, 1), gold.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "model_config": cfg, "vocab_size": vocab_size, "steps": [steps],
                "params_hash": f"trained-{positions}"}, model_dir / "model.pt")
    return model_dir
