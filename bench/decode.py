"""Decoding speed: beam search with the key/value cache against recomputing the whole prefix each step.

    python -m bench.decode [--sentences 100] [--seed 1] [--threads 1]

Same model, same inputs, one run: sentences per second of beam_search(use_cache=True)
and of beam_search(use_cache=False), their ratio, and whether both found the same
tokens. The model is the default preset's (`pipeline.config.compose([])`: model
section, tokenize.vocab_size, translate.beam_size / length_penalty / max_len_a /
max_len_b), randomly initialised; sources are Multi30k-like, 8 to 30 tokens.

Why an EOS bias: an untrained model almost never emits EOS, so every sentence
would run to its maximum length (source + 50) and the uncached search, quadratic
in the output length, would look far worse than it does on real translations.
Training the model to copy first would take minutes of this CPU. Instead the
model is wrapped so EOS's logit gets slope x (t - S_i) at output position t for a
source of S_i tokens: outputs end near the source length, as Multi30k
translations do, while every step still runs the full model (the bias costs
one addition per row). The ratio measured this way is what translating
Multi30k would see; it grows with longer outputs.

Why one thread by default: on a CPU shared with other busy processes, torch's
default of one thread per core makes its threads wait for each other at each
of the hundreds of small operations a cached step runs, which slows the cached
search far more than the uncached one (its products are larger). `--threads 0`
keeps torch's default.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from torch import Tensor, nn

from model.beam_search import Hypothesis, beam_search
from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.config import compose, parse
from pipeline.formats import BOS_ID, EOS_ID, PAD_ID

log = logging.getLogger("bench.decode")


class EosNearSourceLength(nn.Module):
    """A Transformer whose EOS logit is raised by slope x (t - S_i) at output position t (see the docstring).

    Both decoding paths get the same bias: `decode_step` knows t from the state;
    `decode` appends the bias of every position as one extra hidden column, which
    `project` removes and adds to the EOS logit.
    """

    def __init__(self, model: nn.Module, slope: float):
        super().__init__()
        self.model, self.slope, self.pad_id = model, slope, model.pad_id
        self.embedding, self.max_positions = model.embedding, model.max_positions  # what translate_ids reads

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.encode(src)

    def init_state(self, memory: Tensor, src_mask: Tensor):
        return self.model.init_state(memory, src_mask)

    def _bias(self, t: Tensor, src_mask: Tensor) -> Tensor:
        """slope x (t - S) for t [R, T] output positions (1 = first token) and src_mask [R, 1, 1, S]."""
        return self.slope * (t - src_mask.sum(dim=(1, 2, 3))[:, None])

    def decode_step(self, tokens: Tensor, state):
        logits, state = self.model.decode_step(tokens, state)
        t = torch.full((len(tokens), 1), state.position, device=tokens.device)
        logits[:, EOS_ID] += self._bias(t, state.src_mask)[:, 0]
        return logits, state

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        hidden = self.model.decode(tgt_in, memory, src_mask)  # [R, T, D]
        t = torch.arange(1, tgt_in.shape[1] + 1, device=tgt_in.device).expand(tgt_in.shape)  # [R, T]
        return torch.cat([hidden, self._bias(t, src_mask)[..., None]], dim=-1)  # [R, T, D + 1]

    def project(self, hidden: Tensor) -> Tensor:
        logits = self.model.project(hidden[..., :-1])
        logits[..., EOS_ID] += hidden[..., -1]
        return logits


def multi30k_like_sources(n: int, vocab_size: int, generator: torch.Generator) -> Tensor:
    """n random sentences of 8 to 30 tokens (the last EOS), padded: [n, 30]."""
    lengths = torch.randint(8, 31, (n,), generator=generator)
    src = torch.full((n, int(lengths.max())), PAD_ID)
    for i, length in enumerate(lengths.tolist()):
        src[i, : length - 1] = torch.randint(4, vocab_size, (length - 1,), generator=generator)
        src[i, length - 1] = EOS_ID
    return src


def timed_search(model: nn.Module, src: Tensor, translate: dict, use_cache: bool) -> tuple[list[Hypothesis], float]:
    """Beam search over `src` with the preset's settings; (hypotheses, seconds)."""
    start = time.perf_counter()
    hyps = beam_search(
        model, src, translate["beam_size"], translate["length_penalty"], translate["max_len_a"],
        translate["max_len_b"], BOS_ID, EOS_ID, use_cache=use_cache,
    )
    return hyps, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--slope", type=float, default=2.0, help="EOS logit bias per position past the source length")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see the docstring); 0 = torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    cfg = compose([])
    torch.manual_seed(args.seed)
    transformer = Transformer(parse(cfg, "model", ModelConfig), cfg["tokenize"]["vocab_size"])
    model = EosNearSourceLength(transformer, args.slope).eval()
    src = multi30k_like_sources(args.sentences, cfg["tokenize"]["vocab_size"], torch.Generator().manual_seed(args.seed))
    n = len(src)
    log.info("model %s, vocab %d, %d sentences, %d threads", cfg["model"], cfg["tokenize"]["vocab_size"], n,
             torch.get_num_threads())

    timed_search(model, src[:4], cfg["translate"], use_cache=True)  # warm-up: allocator, threads
    log.info("beam search with the cache ...")
    cached, cached_s = timed_search(model, src, cfg["translate"], use_cache=True)
    log.info("beam search recomputing the prefix ...")
    uncached, uncached_s = timed_search(model, src, cfg["translate"], use_cache=False)

    src_len = (src != PAD_ID).sum(1).float().mean().item()
    out_len = sum(len(h.tokens) + 1 for h in cached) / n
    same = [h.tokens for h in cached] == [h.tokens for h in uncached]
    print(f"beam {cfg['translate']['beam_size']}, {n} sentences, mean source {src_len:.1f} tokens, "
          f"mean output {out_len:.1f} tokens (EOS included), {torch.get_num_threads()} threads")
    print(f"cached:   {n / cached_s:8.2f} sentences/s ({cached_s:.2f} s)")
    print(f"uncached: {n / uncached_s:8.2f} sentences/s ({uncached_s:.2f} s)")
    print(f"speedup:  {uncached_s / cached_s:.2f}x; identical tokens: {same}")


if __name__ == "__main__":
    main()
