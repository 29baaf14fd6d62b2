"""Beam search with the GNMT length penalty (Sec. 6.1); beam size 1 is greedy decoding.

The paper: beam size 4, length penalty alpha = 0.6, maximum output length =
input length + 50, "terminating early when possible". The search is batched
over sentences and beams: one `decode_step` per output position for the whole
batch, each row of the decoder state one (sentence, beam) pair; a sentence that
is finished is dropped from the state (`DecoderState.select`), so later steps
cost less. A step reads the device once (which hypotheses stay live: the
host needs their count to size the next step); the best finished hypotheses
stay on the device until the search ends, so a GPU never waits for the host.

Conventions (used everywhere below):
- a hypothesis's length |Y| counts its generated tokens including EOS, not BOS;
- score = log_prob / length_penalty(|Y|, alpha), log_prob including EOS's;
- sentence i may generate at most max_len_i = floor(max_len_a * S_i + max_len_b)
  tokens (EOS included; at least 1), S_i its non-pad source length; at that
  position EOS is forced, so every returned hypothesis ends with EOS.

`model` is a Transformer (model.transformer), or anything with its decoding API:
`pad_id`, `training`, `encode`, `init_state`, `decode_step` (use_cache=True) and
`decode`, `project` (use_cache=False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Hypothesis:
    """One finished translation."""

    tokens: list[int]  # output ids without BOS and without EOS
    score: float  # log_prob / length_penalty(len(tokens) + 1, alpha)
    log_prob: float  # sum of token log-probabilities (EOS included)


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty lp(|Y|) = ((5 + |Y|) / 6) ** alpha (Wu et al. 2016, Eq. 14)."""
    return ((5 + length) / 6) ** alpha


@dataclass
class _PrefixState:
    """Decoder 'state' for use_cache=False: the encoder output per row; the prefix is recomputed each step."""

    memory: Tensor  # [R, S, D]
    src_mask: Tensor  # [R, 1, 1, S]

    def select(self, rows: Tensor, slots: Tensor, sentences: Tensor | None) -> _PrefixState:
        return _PrefixState(self.memory.index_select(0, rows), self.src_mask.index_select(0, rows))


def _start(model, src: Tensor, beam_size: int, use_cache: bool):
    """Encode `src` once; the decoder state holds one empty hypothesis per sentence."""
    memory, src_mask = model.encode(src)
    return model.init_state(memory, src_mask, beam_size) if use_cache else _PrefixState(memory, src_mask)


def _next_logits(model, prefix: Tensor, state, use_cache: bool):
    """Logits of the next token after each row of `prefix` ([R, t], BOS first): ([R, V] float, state)."""
    if use_cache:
        logits, state = model.decode_step(prefix[:, -1], state)
    else:
        logits = model.project(model.decode(prefix, state.memory, state.src_mask)[:, -1])
    return logits.float().contiguous(), state


def top_log_probs(logits: Tensor, k: int, block: int = 64) -> tuple[Tensor, Tensor]:
    """log_softmax(logits).topk(k, dim=1) for logits [R, V] (contiguous; overwritten): ([R, k], [R, k]).

    The vocabulary is cut into blocks of `block` tokens: the k best tokens of a
    row lie in the k blocks with the highest maxima (a block ranked below k
    others has k tokens above its best), so the search for them reads k blocks
    instead of V tokens; the normaliser is one in-place pass of exp over the row.
    In the default's decoding this took 6% of the time where log_softmax + topk
    took 10% (docs/benchmarks.md, "Decoding speed").
    """
    R, V = logits.shape
    n = V // block
    if n <= k:
        return torch.log_softmax(logits, dim=-1).topk(k, dim=1)
    maxima = logits[:, : n * block].view(R, n, block).amax(dim=2)  # [R, n]
    best_blocks = maxima.topk(k, dim=1).indices  # [R, k]
    starts = (best_blocks * block + torch.arange(R, device=logits.device)[:, None] * V).flatten()
    candidates = logits.view(-1).unfold(0, block, 1).index_select(0, starts).view(R, k * block)
    ids = (best_blocks[:, :, None] * block + torch.arange(block, device=logits.device)).view(R, k * block)
    m = maxima.amax(dim=1, keepdim=True)
    if n * block < V:  # the last V % block tokens are candidates too
        tail = logits[:, n * block :]
        candidates = torch.cat([candidates, tail], dim=1)
        ids = torch.cat([ids, torch.arange(n * block, V, device=logits.device).expand(R, -1)], dim=1)
        m = torch.maximum(m, tail.amax(dim=1, keepdim=True))
    top, pos = candidates.topk(k, dim=1)
    log_z = logits.sub_(m).exp_().sum(dim=1, keepdim=True).log_()
    return top.sub_(m).sub_(log_z), ids.gather(1, pos)


def _top_extensions(logits: Tensor, k: int, at_max: Tensor, eos_id: int,
                    forced: int | None = None) -> tuple[Tensor, Tensor]:
    """The k best next tokens of each row and their log-probabilities; rows `at_max` ([R] bool) may only emit
    EOS (keeping EOS's own log-probability; the other k - 1 entries are -inf).

    `forced`: how many rows are at_max, where the caller knows it (beam_search does, on the host), so that
    selecting them reads nothing from the device; None counts them (one read)."""
    if forced is None:
        forced = int(at_max.sum())
    if forced:
        rows = torch.nonzero_static(at_max, size=forced)[:, 0]  # [F]: a known size, no wait for the device
        eos_lp = torch.log_softmax(logits.index_select(0, rows), dim=-1)[:, eos_id]
    top_lp, top_tok = top_log_probs(logits, k)
    if forced:  # EOS first, then k - 1 other tokens at -inf (a row holds each token once)
        others = torch.arange(k - 1, device=logits.device)
        tokens = torch.cat([others.new_full((1,), eos_id), others + (others >= eos_id).long()])
        top_tok.index_copy_(0, rows, tokens.expand(forced, k))
        top_lp.index_copy_(0, rows, torch.cat([eos_lp[:, None], eos_lp.new_full((forced, k - 1), float("-inf"))], 1))
    return top_lp, top_tok


def max_lengths(src: Tensor, pad_id: int, max_len_a: float, max_len_b: int) -> Tensor:
    """floor(max_len_a * S_i + max_len_b) per sentence (at least 1), S_i the non-pad length of row i: [B]."""
    src_len = (src != pad_id).sum(dim=1).double()
    return torch.floor(max_len_a * src_len + max_len_b).long().clamp(min=1)


def _check(model, src: Tensor) -> None:
    assert not model.training, "decode with the model in eval mode (model.eval())"
    if src.dim() != 2:
        raise ValueError(f"src: expected token ids [B, S], got shape {tuple(src.shape)}")


def beam_search(
    model,
    src: Tensor,
    beam_size: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    bos_id: int,
    eos_id: int,
    use_cache: bool = True,
) -> list[Hypothesis]:
    """Best hypothesis per source sentence under score = log_prob / lp(|Y|), in input order.

    Args:
        src: [B, S] token ids padded with model.pad_id, each row ending with EOS.
        use_cache: False recomputes the whole prefix with model.decode each step
            (same tokens, slower; for the benchmark and a parity test).

    Each step extends the K = beam_size live hypotheses of every sentence by
    every token and keeps the 2K best (by log-prob): those among the top K that
    end in EOS are finished; the K best that do not stay live. With K = 1 and
    alpha = 0 this is exactly greedy decoding.

    Early termination, per hypothesis: a live hypothesis with log-prob L after t
    tokens can only lose log-probability, so any finished descendant of length
    n (t < n <= max_len) scores at most L / lp(n) (L <= 0, lp(n) > 0). lp is
    monotone in n, so the best it can reach is L / max(lp(t + 1), lp(max_len))
    (= L / lp(max_len) for alpha > 0, L for alpha = 0). A live hypothesis whose
    bound is <= its sentence's best finished score can never improve on it, nor
    can any hypothesis with a lower log-prob at the same step, which is all
    that would take its place among the K: it is dropped and no longer
    decoded. A sentence stops when none is left (its best finished score is
    >= the bound of its best live hypothesis). Everything that could still win
    is searched exactly as if every sentence ran all K beams to max_len, so the
    returned hypotheses are the same.
    """
    _check(model, src)
    if beam_size < 1:
        raise ValueError(f"beam_size: expected >= 1, got {beam_size}")
    K = beam_size
    with torch.inference_mode():
        B, device = src.shape[0], src.device
        max_len = max_lengths(src, model.pad_id, max_len_a, max_len_b)  # [B]
        max_len_host = max_len.tolist()  # read once per search
        state = _start(model, src, K, use_cache)
        alive = torch.arange(B, device=device)  # original index of each sentence still searched, [n]
        # What the host knows of the search (from one read a step): the sentences alive, their live rows.
        alive_host, beams_host = list(range(B)), [1] * B
        # Rows are live hypotheses; slot[r] = i * K + j puts row r in beam j of sentence alive[i].
        slot = torch.arange(B, device=device) * K  # [R]: one empty hypothesis per sentence to start
        prefix = torch.full((B, 1), bos_id, dtype=torch.long, device=device)  # [R, t+1]
        row_lp = torch.zeros(B, device=device)  # [R]
        # The best finished hypothesis of each sentence, kept on the device: its score, log-prob, tokens (the
        # first best_len of best_tokens; -1: none yet).
        best_score = torch.full((B,), float("-inf"), device=device)
        best_lp = torch.zeros(B, device=device)
        best_len = torch.full((B,), -1, dtype=torch.long, device=device)
        best_tokens = torch.zeros(B, max(max_len_host, default=1), dtype=torch.long, device=device)
        t = 0
        while alive_host:
            t += 1  # tokens generated after this step
            n = len(alive_host)
            logits, state = _next_logits(model, prefix, state, use_cache)  # [R, V]
            forced = sum(beams for i, beams in zip(alive_host, beams_host) if max_len_host[i] == t)
            top_lp, top_tok = _top_extensions(logits, min(2 * K, logits.shape[-1]), (max_len[alive] == t)[slot // K],
                                              eos_id, forced)  # [R, C], best first
            # The 2K best extensions of each sentence are among its rows' C best: gather them in the
            # [n, K] grid of beam slots (-inf where a slot holds no hypothesis), then pick per sentence.
            C = top_lp.shape[1]
            grid = torch.full((n * K, C), float("-inf"), device=device).index_copy_(0, slot, row_lp[:, None] + top_lp)
            cand_lp, cand_idx = grid.view(n, K * C).topk(min(2 * K, K * C), dim=1)  # [n, 2K], best first
            row_of_slot = torch.zeros(n * K, dtype=torch.long, device=device).index_copy_(
                0, slot, torch.arange(len(slot), device=device))
            cand_row = row_of_slot[torch.arange(n, device=device)[:, None] * K + cand_idx // C]  # [n, 2K]
            cand_tok = top_tok[cand_row, cand_idx % C]
            is_eos = cand_tok == eos_id

            # Finished: EOS among the top K (finite: forced rows have -inf elsewhere).
            rank = torch.arange(cand_lp.shape[1], device=device)
            finish = is_eos & (rank < K) & torch.isfinite(cand_lp)
            fin_score = torch.where(finish, cand_lp / length_penalty(t, alpha), float("-inf"))
            step_score, step_pos = fin_score.max(dim=1)  # [n]
            before = best_score[alive]
            improved = step_score > before  # [n]: its best finished hypothesis is this step's
            tokens = prefix.index_select(0, cand_row.gather(1, step_pos[:, None])[:, 0])[:, 1:]  # [n, t-1]
            best_tokens[alive, : t - 1] = torch.where(improved[:, None], tokens, best_tokens[alive, : t - 1])
            best_len[alive] = torch.where(improved, t - 1, best_len[alive])
            best_lp[alive] = torch.where(improved, cand_lp.gather(1, step_pos[:, None])[:, 0], best_lp[alive])
            best_score[alive] = torch.maximum(before, step_score)

            # Live: the K best candidates that do not end in EOS (at most K of the 2K do), best first ...
            keep_pos = torch.where(is_eos, rank + 2 * K, rank).topk(K, dim=1, largest=False).values  # [n, K]
            beam_lp = cand_lp.gather(1, keep_pos)
            # ... of which those that can still beat their sentence's best finished hypothesis.
            reachable_lp = length_penalty(max_len[alive].float(), alpha).clamp(min=length_penalty(t + 1, alpha))
            live = (beam_lp / reachable_lp[:, None] > before.maximum(step_score)[:, None]) & (max_len[alive] > t)[:, None]
            live_host = live.tolist()  # the step's one read from the device: what to decode next
            kept_host = [i for i, row in enumerate(live_host) if any(row)]
            if not kept_host:
                break
            beams_host = [sum(live_host[i]) for i in kept_host]
            # The same selection on the device, its sizes known: nonzero_static waits for nothing.
            kept = torch.nonzero_static(live.any(dim=1), size=len(kept_host))[:, 0]  # [n']
            live = live.index_select(0, kept)  # [n', K]
            slot = torch.nonzero_static(live.flatten(), size=sum(beams_host))[:, 0]  # [R']

            def follow(x: Tensor) -> Tensor:
                """x [n, K] per (sentence, kept candidate) -> [R'] per new row."""
                return x.index_select(0, kept).flatten().index_select(0, slot)

            rows = follow(cand_row.gather(1, keep_pos))  # [R']
            state = state.select(rows, slot, kept if len(kept_host) < n else None)
            prefix = torch.cat([prefix.index_select(0, rows), follow(cand_tok.gather(1, keep_pos))[:, None]], dim=1)
            row_lp, alive = follow(beam_lp), alive.index_select(0, kept)
            alive_host = [alive_host[i] for i in kept_host]
        tokens, lengths, scores, log_probs = (x.tolist() for x in (best_tokens, best_len, best_score, best_lp))
        return [Hypothesis(tokens[i][:n], scores[i], log_probs[i]) if n >= 0 else None
                for i, n in enumerate(lengths)]
