"""Sample efficiency: validation perplexity against target tokens trained, and greedy BLEU at the end.

    dvc repro tokenize                     # data/tokenized of the default preset (Multi30k)
    python -m bench.sample_efficiency [OVERRIDE ...] [--million-tokens 1.5] [--every 0.25] [--init xavier]

OVERRIDEs are Hydra overrides of conf/, as `dvc exp run -S` takes them, e.g.
`batch.max_tokens=2500 train.warmup_steps=400`. Trains the composed model with the
train stage's loss and the paper's schedule on the tokenized corpus, one batch
per step, and prints the valid perplexity every `--every` million real target
tokens, then greedy BLEU (sacreBLEU, 13a) on the test split. Counting tokens
rather than minutes makes runs comparable on a busy machine: two can run side
by side (`--threads 1` each). This is how the default preset's batch size,
schedule and initialisation were chosen (README, "Choosing the small model").

`--init xavier` re-initialises every attention and feed-forward matrix with
Xavier-uniform (W^Q, W^K, W^V each on its own), the scheme the model used
before, to compare with the model's own initialisation.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from model.loss import SmoothedLoss, real_hidden, smoothed_and_nll
from model.schedule import lrate
from model.transformer import FeedForward, MultiHeadAttention, Transformer, build_transformer
from stages import config
from stages.batch import make_batches
from stages.config import BatchConfig, ModelConfig, TokenizeConfig, TrainConfig, TranslateConfig
from stages.corpus import load_split, read_meta
from stages.evaluate import read_lines, score
from stages.train import make_batch
from stages.translate import detokenize, load_spm, translate_ids


def composed(overrides: list[str]) -> Path:
    """params.yaml of conf/ with `overrides`, in a temporary file, for stages.config.load."""
    path = Path(tempfile.mkdtemp()) / "params.yaml"
    path.write_text(yaml.safe_dump(config.compose(overrides)))
    return path


def xavier(model: Transformer) -> None:
    """Xavier-uniform on each attention block and feed-forward matrix (see the docstring); biases stay zero."""
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            h, d_k, d_v = module.n_heads, module.d_k, module.d_v
            blocks = ([(module.w_qkv, [h * d_k, h * d_k, h * d_v])] if module.self_attention
                      else [(module.w_q, [h * d_k]), (module.w_kv, [h * d_k, h * d_v])])
            for linear, sizes in blocks + [(module.w_o, [module.w_o.out_features])]:
                for block in linear.weight.data.split(sizes, dim=0):
                    nn.init.xavier_uniform_(block)
        elif isinstance(module, FeedForward):
            nn.init.xavier_uniform_(module.w_1.weight)
            nn.init.xavier_uniform_(module.w_2.weight)


def valid_ppl(model: Transformer, batches: list) -> float:
    model.eval()
    nll = tokens = 0.0
    with torch.no_grad():
        for b in batches:
            hidden, targets = real_hidden(model, b.src, b.tgt_in, b.labels)
            nll += smoothed_and_nll(model.project(hidden), targets, 0.0)[1].item()
            tokens += b.tokens
    model.train()
    return math.exp(nll / tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--raw", type=Path, default=Path("data/raw"))
    parser.add_argument("--million-tokens", type=float, default=1.5)
    parser.add_argument("--every", type=float, default=0.25, help="million tokens between validations")
    parser.add_argument("--init", choices=["model", "xavier"], default="model")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = composed(args.overrides)
    model_cfg, cfg = config.load(params, "model", ModelConfig), config.load(params, "train", TrainConfig)
    max_tokens = config.load(params, "batch", BatchConfig).max_tokens
    meta = read_meta(args.tokenized)
    src_lang, tgt_lang = meta["src_lang"], meta["tgt_lang"]
    if meta["vocab_size"] != config.load(params, "tokenize", TokenizeConfig).vocab_size:
        raise SystemExit(f"{args.tokenized}: vocabulary {meta['vocab_size']} differs from the overrides'; "
                         "re-run `dvc repro tokenize` with them")
    split = {(s, lang): load_split(args.tokenized, s, lang) for s in ("train", "valid") for lang in (src_lang, tgt_lang)}
    cpu = torch.device("cpu")

    def batches(name: str, limit: int) -> list:
        S, T = (split[name, lang].lengths + 1 for lang in (src_lang, tgt_lang))
        stored = make_batches(S, T, limit, seed=cfg.seed, split=name)
        return [make_batch(split[name, src_lang], split[name, tgt_lang], stored[i], cpu) for i in range(len(stored))]

    train, valid = batches("train", max_tokens), batches("valid", 4000)
    torch.manual_seed(cfg.seed)
    model = build_transformer(int(meta["vocab_size"]), **vars(model_cfg))
    if args.init == "xavier":
        xavier(model)
    loss_model = SmoothedLoss(model, cfg.label_smoothing)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    print(f"{' '.join(args.overrides) or 'default preset'}, init {args.init}: {len(train)} batches of <= {max_tokens} "
          f"tokens, warmup {cfg.warmup_steps}, lr_factor {cfg.lr_factor}", flush=True)
    rng, step, tokens, next_eval, start = np.random.default_rng(cfg.seed), 0, 0, args.every * 1e6, time.time()
    while tokens < args.million_tokens * 1e6:
        for i in rng.permutation(len(train)):
            b, step = train[i], step + 1
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr_factor * lrate(step, model_cfg.d_model, cfg.warmup_steps)
            (loss_model(b.src, b.tgt_in, b.labels) / b.tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens += b.tokens
            if tokens >= next_eval:
                next_eval += args.every * 1e6
                print(f"{tokens / 1e6:.2f}M tokens, step {step}: valid ppl {valid_ppl(model, valid):.2f} "
                      f"({(time.time() - start) / 60:.1f} min)", flush=True)
            if tokens >= args.million_tokens * 1e6:
                break
    model.eval()
    translate_cfg = replace(config.load(params, "translate", TranslateConfig), beam_size=1)
    hyps = detokenize(load_spm(args.tokenized, model), translate_ids(model, load_split(args.tokenized, "test", src_lang),
                                                                     translate_cfg, progress=False))
    refs = read_lines(args.raw / f"test.{tgt_lang}")
    result = score(hyps, refs, tgt_lang, "13a")
    print(f"greedy test BLEU {result.bleu:.2f} after {tokens / 1e6:.2f}M tokens, {step} steps ({result.signature})")


if __name__ == "__main__":
    main()
