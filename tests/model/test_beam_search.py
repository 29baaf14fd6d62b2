"""Beam search (model/beam_search.py) on tiny random models and scripted ones, against a plain greedy reference."""

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from model.beam_search import Hypothesis, _top_extensions, beam_search, length_penalty, top_log_probs
from tests.fixtures.beam import A, BOS, EOS, PAD, V, EosBias, sources, tiny_model


def rescore(model, src_row: torch.Tensor, tokens: list[int], alpha: float) -> tuple[float, float]:
    """(log_prob, score) of `tokens` + EOS given one source sentence, from one full forward pass."""
    src_row = src_row[src_row != PAD]
    tgt_in, targets = torch.tensor([[BOS] + tokens]), torch.tensor([tokens + [EOS]])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(src_row[None], tgt_in), dim=-1)
    log_prob = log_probs.gather(2, targets[..., None]).sum().item()
    return log_prob, log_prob / length_penalty(len(tokens) + 1, alpha)


def greedy_search(model, src: torch.Tensor, max_len_a: float, max_len_b: int) -> list[Hypothesis]:
    """The reference: one sentence at a time, the whole prefix re-run through model(src, tgt_in) each step."""
    out = []
    for row in src:
        row = row[row != PAD]
        max_len, tokens, log_prob = max(1, math.floor(max_len_a * len(row) + max_len_b)), [], 0.0
        with torch.no_grad():
            for t in range(1, max_len + 1):
                log_probs = torch.log_softmax(model(row[None], torch.tensor([[BOS] + tokens]))[0, -1], dim=-1)
                token = EOS if t == max_len else int(log_probs.argmax())
                log_prob += log_probs[token].item()
                if token == EOS:
                    break
                tokens.append(token)
        out.append(Hypothesis(tokens, log_prob, log_prob))
    return out


def test_length_penalty_is_the_gnmt_formula():
    assert length_penalty(1, 0.6) == 1.0
    assert math.isclose(length_penalty(7, 0.6), 2**0.6)
    assert math.isclose(length_penalty(10, 0.6), (15 / 6) ** 0.6)
    assert length_penalty(30, 0.0) == 1.0
    torch.testing.assert_close(length_penalty(torch.tensor([1.0, 7.0]), 1.0), torch.tensor([1.0, 2.0]))


def test_beam_size_one_equals_greedy():
    """With alpha = 0 (greedy has no length penalty); with alpha > 0, K = 1 may keep searching past an EOS."""
    model, src = tiny_model(), sources([4, 9, 6, 2, 7, 5, 8, 3], seed=1)
    greedy = greedy_search(model, src, 1.0, 6)
    beam = beam_search(model, src, 1, 0.0, 1.0, 6, BOS, EOS)
    assert [h.tokens for h in beam] == [h.tokens for h in greedy]
    for b, g in zip(beam, greedy):
        assert math.isclose(b.log_prob, g.log_prob, rel_tol=1e-5)


def test_beam_of_four_scores_at_least_as_high_as_greedy():
    model, src, alpha = tiny_model(seed=2), sources([4, 9, 6, 2, 7, 5, 8, 3], seed=2), 0.6
    beam = beam_search(model, src, 4, alpha, 1.0, 6, BOS, EOS)
    greedy = greedy_search(model, src, 1.0, 6)
    better = 0
    for row, b, g in zip(src, beam, greedy):
        b_log_prob, b_score = rescore(model, row, b.tokens, alpha)
        _, g_score = rescore(model, row, g.tokens, alpha)
        assert math.isclose(b.log_prob, b_log_prob, rel_tol=1e-4) and math.isclose(b.score, b_score, rel_tol=1e-4)
        assert b_score >= g_score - 1e-5
        better += b_score > g_score + 1e-5
    assert better > 0  # the search found something greedy missed


@pytest.mark.parametrize("beam_size", [1, 3])
def test_maximum_length_follows_each_sentences_source_length(beam_size):
    lengths, a, b = [3, 5, 6, 2], 1.5, 2
    model, src = EosBias(tiny_model(), -1e4).eval(), sources([3, 5, 6, 2], seed=3)
    hyps = beam_search(model, src, beam_size, 0.6, a, b, BOS, EOS)
    # Every output hits its own bound floor(a * S_i + b), EOS counted, and EOS is forced there.
    assert [len(h.tokens) + 1 for h in hyps] == [math.floor(a * n + b) for n in lengths] == [6, 9, 11, 5]
    assert all(EOS not in h.tokens for h in hyps)


@dataclass
class ScriptedState:
    k: torch.Tensor  # [R] step at which EOS becomes likely, per row
    position: int

    def select(self, rows, slots, sentences) -> "ScriptedState":
        return ScriptedState(self.k.index_select(0, rows), self.position)


class Scripted(nn.Module):
    """Next-token distribution set by the step t alone: before step k, A 0.7 and B 0.3; from k on, EOS 0.5,
    A 0.3, B 0.2 (PAD, UNK, BOS never). k is the first source token's id. Records the rows of every call."""

    pad_id = PAD

    def __init__(self):
        super().__init__()
        self.calls: list[int] = []

    def encode(self, src):
        return src[:, :1, None].float(), (src != PAD)[:, None, None, :]

    def init_state(self, memory, src_mask, beams):
        return ScriptedState(memory[:, 0, 0].long(), 0)

    def decode_step(self, tokens, state):
        self.calls.append(len(tokens))
        state.position += 1
        early = torch.tensor([0, 0, 0, 0, 0.7, 0.3]).log()
        late = torch.tensor([0, 0, 0, 0.5, 0.3, 0.2]).log()
        return torch.where((state.position >= state.k)[:, None], late, early), state


def scripted_source(k: int, length: int) -> list[int]:
    return [k] + [A] * (length - 2) + [EOS]


def test_early_termination_without_length_penalty_stops_at_the_first_eos():
    """alpha = 0: the first EOS (A^(k-1) EOS) beats every live hypothesis, so sentence i stops at step k_i."""
    model = Scripted().eval()
    src = torch.tensor([scripted_source(2, 5), scripted_source(4, 5)])
    hyps = beam_search(model, src, 2, 0.0, 1.0, 50, BOS, EOS)  # max length 55
    # Step 1 decodes one empty hypothesis per sentence; the first sentence leaves the batch after step 2.
    assert model.calls == [2, 4, 2, 2]
    assert [h.tokens for h in hyps] == [[A], [A, A, A]]
    assert math.isclose(hyps[1].log_prob, 3 * math.log(0.7) + math.log(0.5), rel_tol=1e-6)


def test_early_termination_with_length_penalty_stops_when_the_bound_allows():
    """alpha = 0.6: the best live hypothesis after t >= k steps is A^t, log-prob L_t = (k-1) log .7 +
    (t-k+1) log .3, and may still reach L_t / lp(max_len); the best finished is max over s <= t of
    ((k-1) log .7 + (s-k) log .3 + log .5) / lp(s). The search must stop at the first t where the
    finished one is at least the bound, not earlier, not at max_len."""
    k, alpha, max_len = 3, 0.6, 55
    finished, expected_steps = float("-inf"), None
    for t in range(k, max_len + 1):
        L_k = (k - 1) * math.log(0.7)
        finished = max(finished, (L_k + (t - k) * math.log(0.3) + math.log(0.5)) / length_penalty(t, alpha))
        if finished >= (L_k + (t - k + 1) * math.log(0.3)) / length_penalty(max_len, alpha):
            expected_steps = t
            break
    assert expected_steps == 6  # k < 6 < max_len: the bound, not the first EOS or the length, decides
    model = Scripted().eval()
    (hyp,) = beam_search(model, torch.tensor([scripted_source(k, 5)]), 2, alpha, 1.0, 50, BOS, EOS)
    assert len(model.calls) == expected_steps
    assert hyp.tokens == [A, A] and math.isclose(hyp.score, finished, rel_tol=1e-6)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_cached_and_uncached_search_give_identical_tokens(beam_size):
    model, src = tiny_model(seed=4), sources([4, 9, 6, 2, 7], seed=4)
    cached, uncached = (beam_search(model, src, beam_size, 0.6, 1.0, 8, BOS, EOS, use_cache=c) for c in (True, False))
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    for c, u in zip(cached, uncached):
        assert math.isclose(c.score, u.score, rel_tol=1e-4)


def test_batched_results_equal_one_sentence_at_a_time_in_input_order():
    model, lengths = tiny_model(seed=5), [4, 9, 6, 2, 7, 3]
    src = sources(lengths, seed=5)
    batched = beam_search(model, src, 4, 0.6, 1.0, 8, BOS, EOS)
    for row, n, hyp in zip(src, lengths, batched):
        (alone,) = beam_search(model, row[None, :n], 4, 0.6, 1.0, 8, BOS, EOS)
        assert alone.tokens == hyp.tokens and math.isclose(alone.score, hyp.score, rel_tol=1e-4)
    reversed_ = beam_search(model, src.flip(0), 4, 0.6, 1.0, 8, BOS, EOS)
    assert [h.tokens for h in reversed_] == [h.tokens for h in reversed(batched)]
    assert len({tuple(h.tokens) for h in batched}) > 1  # distinct outputs, so order is actually tested


def test_training_mode_is_refused():
    model = tiny_model().train()
    with pytest.raises(AssertionError, match="eval"):
        beam_search(model, sources([3]), 2, 0.6, 1.0, 5, BOS, EOS)


def reference_beam_search(model, src_row: torch.Tensor, K: int, alpha: float, max_len_a: float,
                          max_len_b: int) -> Hypothesis:
    """The search as specified, for one sentence: all K beams every step, the whole prefix re-run through
    model(src, tgt_in), stopping when the best finished score reaches the best live hypothesis's bound."""
    src_row = src_row[src_row != PAD][None]
    max_len = max(1, math.floor(max_len_a * src_row.shape[1] + max_len_b))
    beams, best = [([], 0.0)], None
    with torch.no_grad():
        for t in range(1, max_len + 1):
            cands = []
            for tokens, lp in beams:
                log_probs = torch.log_softmax(model(src_row, torch.tensor([[BOS] + tokens]))[0, -1], dim=-1)
                allowed = [EOS] if t == max_len else range(V)
                cands += [(lp + log_probs[v].item(), tokens, v) for v in allowed]
            cands = sorted(cands, key=lambda c: -c[0])[: 2 * K]
            for lp, tokens, v in cands[:K]:
                if v == EOS and (best is None or lp / length_penalty(t, alpha) > best.score):
                    best = Hypothesis(tokens, lp / length_penalty(t, alpha), lp)
            beams = [(tokens + [v], lp) for lp, tokens, v in cands if v != EOS][:K]
            reach = max(length_penalty(t + 1, alpha), length_penalty(max_len, alpha))
            if t == max_len or (best is not None and best.score >= beams[0][1] / reach):
                return best


@pytest.mark.parametrize("beam_size, alpha", [(2, 0.0), (4, 0.6), (3, 1.0)])
def test_dropping_hypotheses_that_cannot_win_finds_what_the_full_search_finds(beam_size, alpha):
    """With EOS made likelier, finished hypotheses appear early and live ones fall behind them: the search then
    decodes fewer than K hypotheses per sentence, and still returns what all K would."""
    dropped = []
    for seed in range(3):
        model = EosBias(tiny_model(seed=10 + seed), 2.0).eval()
        src = sources([5, 3, 8, 6, 4], seed=seed)
        hyps = beam_search(model, src, beam_size, alpha, 1.0, 8, BOS, EOS)
        for row, hyp in zip(src, hyps):
            ref = reference_beam_search(model, row, beam_size, alpha, 1.0, 8)
            assert hyp.tokens == ref.tokens and math.isclose(hyp.score, ref.score, rel_tol=1e-4)
        dropped.append(sum(beam_size * sentences - rows for rows, sentences in model.steps[1:]))
    assert all(dropped)


@pytest.mark.parametrize("vocab, k", [(5000, 8), (5003, 8), (37000, 8), (640, 2), (100, 8), (7, 7)])
def test_top_log_probs_equal_log_softmax_then_topk(vocab, k):
    logits = torch.randn(50, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    logits[3, vocab - 1] = 40.0  # a best token in the last, partial block
    expected_lp, expected_ids = torch.log_softmax(logits, dim=-1).topk(k, dim=1)
    lp, ids = top_log_probs(logits.clone(), k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(lp, expected_lp, rtol=0, atol=1e-4)


def test_a_row_at_its_length_limit_offers_eos_alone_with_its_own_log_probability():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    at_max = torch.tensor([False, True, False])
    lp, tok = _top_extensions(logits.clone(), 4, at_max, eos_id=2)
    expected_lp, expected_tok = torch.log_softmax(logits, dim=-1).topk(4, dim=1)
    assert torch.equal(tok[[0, 2]], expected_tok[[0, 2]])
    assert tok[1, 0] == 2 and (tok[1, 1:] != 2).all() and len(set(tok[1].tolist())) == 4
    torch.testing.assert_close(lp[1, 0], torch.log_softmax(logits[1], dim=-1)[2])
    assert torch.isinf(lp[1, 1:]).all()
