"""Sample efficiency: validation perplexity against target tokens trained, and greedy BLEU at the end.

    dvc repro tokenize                     # data/tokenized of the default preset (Multi30k)
    python -m bench.cpu.sample_efficiency [OVERRIDE ...] [--million-tokens 1.5] [--every 0.25] [--init xavier]

OVERRIDEs are Hydra overrides of conf/, as `dvc exp run -S` takes them, e.g.
`batch.max_tokens=2500 train.warmup_steps=400`. Ragged the tokenized corpus with
the batch stage (into a temporary directory), trains the composed model with the
train stage's Trainer (pipeline/training/trainer.py: same loss, schedule, optimizer and
accumulation), and prints the valid perplexity every `--every` million real
target tokens, then greedy BLEU (sacreBLEU, 13a, and Multi30k's lc.norm.tok BLEU) on
the validation split: choices are made on validation data, never on test2016,
which is scored once per final candidate by the pipeline. Counting tokens
rather than minutes makes runs comparable on a busy machine: two can run side
by side (`--threads 1` each). docs/results.md's tuning record gives its
figures for each candidate, with the hardware.

`--init xavier` re-initialises every attention and feed-forward matrix with
Xavier-uniform (W^Q, W^K, W^V each on its own), the scheme the model used
before, to compare with the model's own initialisation.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from model.config import ModelConfig
from model.transformer import FeedForward, MultiHeadAttention, Transformer
from pipeline.core import config
from pipeline.device import distributed
from pipeline.device.precision import resolve
from pipeline.core.config import BatchConfig, TokenizeConfig, TrainConfig, TranslateConfig
from pipeline.corpus import steps
from pipeline.corpus.batching import write_batches
from pipeline.corpus.formats import load_spm, load_split, read_meta
from pipeline.training.loader import TrainingData
from pipeline.core.tracking import StageRun
from pipeline.training.trainer import Trainer
from pipeline.translation.scoring import multi30k_bleu, read_lines, score
from pipeline.corpus.formats import detokenize
from pipeline.translation.decoding import translate_ids


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
    params = config.compose(args.overrides)
    model_cfg, cfg = config.parse(params, "model", ModelConfig), config.parse(params, "train", TrainConfig)
    max_tokens = config.parse(params, "batch", BatchConfig).max_tokens
    meta = read_meta(args.tokenized)
    if meta["vocab_size"] != config.parse(params, "tokenize", TokenizeConfig).vocab_size:
        raise SystemExit(f"{args.tokenized}: vocabulary {meta['vocab_size']} differs from the overrides'; "
                         "re-run `dvc repro tokenize` with them")
    with tempfile.TemporaryDirectory() as tmp:
        batch_cfg = config.parse(params, "batch", BatchConfig)
        write_batches(args.tokenized, Path(tmp) / "batches", Path(tmp) / "batch.json", batch_cfg,
                      steps.batches_per_step(cfg.tokens_per_step, max_tokens), cfg.seed)  # as the batch stage does
        data = TrainingData.load(args.tokenized, Path(tmp) / "batches")
        ctx = distributed.Dist(0, 1, 0, torch.device("cpu"))
        trainer = Trainer(data, model_cfg, cfg, max_tokens, ctx, StageRun(), phash="",
                          precision=resolve(cfg.cpu_matmul, ctx.device))
        if args.init == "xavier":
            xavier(trainer.model)
        print(f"{' '.join(args.overrides) or 'default preset'}, init {args.init}: {len(data.train_batches)} batches of "
              f"<= {max_tokens} tokens, warmup {cfg.warmup_steps}, lr_factor {cfg.lr_factor}", flush=True)
        p, next_eval, start = trainer.progress, args.every * 1e6, time.time()
        while p.train_tokens < args.million_tokens * 1e6:
            trainer.step(trainer.epoch_order())
            if p.train_tokens >= next_eval:
                next_eval += args.every * 1e6
                print(f"{p.train_tokens / 1e6:.2f}M tokens, step {p.step}: valid ppl {trainer.validate()['valid_ppl']:.2f} "
                      f"({(time.time() - start) / 60:.1f} min)", flush=True)
    model = trainer.model.eval()
    translate_cfg = replace(config.parse(params, "translate", TranslateConfig), beam_size=1)
    sources = load_split(args.tokenized, "valid", meta["src_lang"])
    hyps = detokenize(load_spm(args.tokenized, data.vocab_size), translate_ids(model, sources, translate_cfg, progress=False))
    refs = read_lines(args.raw / f"valid.{meta['tgt_lang']}")
    result = score(hyps, refs, meta["tgt_lang"], "13a")
    print(f"greedy valid BLEU {result.bleu:.2f}, lc.norm.tok {multi30k_bleu(hyps, refs, meta['tgt_lang']):.2f} after "
          f"{p.train_tokens / 1e6:.2f}M tokens, {p.step} steps ({result.signature})")


if __name__ == "__main__":
    main()
