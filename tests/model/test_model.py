"""The Transformer of model/transformer.py against the paper's formulas (Sec. 3) and its own full pass."""

import math

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.positions import sinusoidal_encoding
from model.transformer import MultiHeadAttention, Transformer, padding_mask
from pipeline.core.config import compose

PAD, BOS, EOS = 0, 2, 3
V = 40


# d_model 16, 2 layers, d_k != d_v so that a mixed-up projection shows
TINY = dict(n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=6, dropout=0.1,
            positional_encoding="sinusoidal", max_positions=64)


def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """The TINY model in eval mode (no dropout)."""
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**TINY, **overrides}), V).eval()


def random_tokens(B: int, L: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Ids of ordinary tokens (no PAD/UNK/BOS/EOS), [B, L]."""
    return torch.randint(4, V, (B, L), generator=generator)


def reference_attention(q, k, v, mask, explicit: bool):
    """softmax(Q K^T / sqrt(d_k)) V written out, or through F.scaled_dot_product_attention."""
    if not explicit:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


def split_heads(x, H):
    B, L, _ = x.shape
    return x.view(B, L, H, -1).transpose(1, 2)


def test_self_attention_matches_hand_implementation():
    torch.manual_seed(0)
    D, H, d_k, d_v, B, L = 16, 2, 8, 6, 3, 5
    mha = MultiHeadAttention(D, H, d_k, d_v, self_attention=True)
    x = torch.randn(B, L, D)
    lengths = torch.tensor([5, 3, 1])
    key_mask = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    W, b = mha.w_qkv.weight, mha.w_qkv.bias
    W_q, W_k, W_v = W.split([H * d_k, H * d_k, H * d_v])
    b_q, b_k, b_v = b.split([H * d_k, H * d_k, H * d_v])
    q, k, v = (split_heads(x @ w.t() + bias, H) for w, bias in ((W_q, b_q), (W_k, b_k), (W_v, b_v)))
    for mask, is_causal in ((key_mask, False), (causal.expand(B, 1, L, L), True)):
        ours = mha(x, None if is_causal else mask, causal=is_causal)
        for explicit in (False, True):
            heads = reference_attention(q, k, v, mask, explicit)  # [B, H, L, d_v]
            ref = mha.w_o(heads.transpose(1, 2).reshape(B, L, H * d_v))
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_cross_attention_matches_hand_implementation_and_weights_sum_to_one():
    torch.manual_seed(1)
    D, H, d_k, d_v, B, T, S = 16, 4, 4, 5, 2, 3, 6
    mha = MultiHeadAttention(D, H, d_k, d_v, self_attention=False)
    y, memory = torch.randn(B, T, D), torch.randn(B, S, D)
    mask = (torch.arange(S)[None, :] < torch.tensor([6, 2])[:, None])[:, None, None, :]
    q = split_heads(mha.w_q(y), H)
    W_k, W_v = mha.w_kv.weight.split([H * d_k, H * d_v])
    b_k, b_v = mha.w_kv.bias.split([H * d_k, H * d_v])
    k, v = split_heads(memory @ W_k.t() + b_k, H), split_heads(memory @ W_v.t() + b_v, H)
    ours = mha(y, mask, memory=memory)
    for explicit in (False, True):
        ref = mha.w_o(reference_attention(q, k, v, mask, explicit).transpose(1, 2).reshape(B, T, H * d_v))
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    weights = mha.weights(y, memory, mask)  # [B, H, T, S]
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T))
    assert torch.all(weights[1, :, :, 2:] == 0)


def test_future_target_tokens_do_not_change_earlier_logits():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    src, tgt = random_tokens(2, 7, g), random_tokens(2, 6, g)
    changed = tgt.clone()
    changed[:, 3:] = random_tokens(2, 3, g)
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=1e-6)
    assert (a[:, 3:] - b[:, 3:]).abs().max() > 1e-3  # the later positions do see their own tokens


def test_tokens_behind_the_source_mask_do_not_matter():
    """Keep the mask of `src` but feed other ids at its padded positions: real positions are unchanged."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    src, tgt = random_tokens(2, 6, g), random_tokens(2, 4, g)
    src[1, 4:] = PAD
    mask = padding_mask(src, PAD)
    other = src.clone()
    other[1, 4:] = random_tokens(1, 2, g)

    def encode_with(tokens):
        x = model.embed(tokens)
        for layer in model.encoder:
            x = layer(x, mask)
        return x

    with torch.no_grad():
        memory, changed = encode_with(src), encode_with(other)
        torch.testing.assert_close(memory, model.encode(src)[0])
        torch.testing.assert_close(memory[1, :4], changed[1, :4], rtol=0, atol=1e-6)
        torch.testing.assert_close(model.decode(tgt, memory, mask), model.decode(tgt, changed, mask), rtol=0, atol=1e-6)


def test_extra_padding_leaves_outputs_unchanged():
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    src, tgt = random_tokens(2, 5, g), random_tokens(2, 4, g)
    padded = torch.cat([src, torch.full((2, 3), PAD)], dim=1)
    with torch.no_grad():
        memory, padded_memory = model.encode(src)[0], model.encode(padded)[0]
        torch.testing.assert_close(memory, padded_memory[:, :5], rtol=0, atol=1e-5)
        torch.testing.assert_close(model(src, tgt), model(padded, tgt), rtol=0, atol=1e-5)
    # A short sentence padded inside a batch decodes as it does alone.
    alone = src[:1, :3]
    batch = torch.cat([torch.cat([alone, torch.full((1, 2), PAD)], dim=1), src[1:]])
    with torch.no_grad():
        torch.testing.assert_close(model(alone, tgt[:1]), model(batch, tgt)[:1], rtol=0, atol=1e-5)


def test_sinusoidal_encoding_matches_the_formula():
    d_model = 16
    pe = sinusoidal_encoding(60, d_model)
    for pos in (0, 1, 7, 59):
        for i in (0, 1, 5, 7):
            angle = pos / 10000 ** (2 * i / d_model)
            assert math.isclose(pe[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)


def test_embedding_is_shared_and_scaled_by_sqrt_d_model():
    model = tiny_model()
    matrices = [p for p in model.parameters() if p.shape == (V, 16)]
    assert len(matrices) == 1  # one [V, D] matrix: no separate output layer
    src = torch.tensor([[4, 5, 6, 7]])  # source-only ids
    tgt = torch.tensor([[BOS, 20, 21]])  # target-only ids
    with torch.no_grad():
        expected = model.embedding.weight[src] * math.sqrt(16) + sinusoidal_encoding(64, 16)[:4]
        torch.testing.assert_close(model.embed(src), expected)
        hidden = torch.randn(3, 16)
        torch.testing.assert_close(model.project(hidden), hidden @ model.embedding.weight.t())
        # The one matrix feeds the encoder input and the decoder input too.
        memory, mask = model.encode(src)
        decoded = model.decode(tgt, memory, mask)
        model.embedding.weight[5] += 1.0
        assert (model.encode(src)[0] - memory).abs().max() > 1e-3
        model.embedding.weight[20] += 1.0
        assert (model.decode(tgt, memory, mask) - decoded).abs().max() > 1e-3


@pytest.mark.parametrize("positional_encoding", ["sinusoidal", "rotary"])
def test_incremental_decoding_equals_the_full_pass_also_after_select(positional_encoding):
    model = tiny_model(positional_encoding=positional_encoding)
    g = torch.Generator().manual_seed(3)
    src, tgt = random_tokens(3, 6, g), random_tokens(3, 7, g)
    src[2, 3:] = PAD
    tgt[:, 0] = BOS
    with torch.no_grad():
        full = model(src, tgt)  # [B, T, V]
        memory, src_mask = model.encode(src)
        state = model.init_state(memory, src_mask, beams=2)
        # Halfway, as beam search does: sentence 1 leaves, sentence 2's hypothesis moves to beam 1 and
        # sentence 0's is repeated into both of its beams (rows [2, 0, 0] in grid slots [1, 2, 3]).
        order = torch.tensor([2, 0, 0])
        for t in range(tgt.shape[1]):
            if t == 3:
                state = state.select(order, torch.tensor([1, 2, 3]), torch.tensor([2, 0]))
            rows = order if t >= 3 else torch.arange(3)
            logits, state = model.decode_step(tgt[rows, t], state)
            assert (logits - full[rows, t]).abs().max() < 1e-5
        assert state.position == tgt.shape[1]


def parameter_count(experiment: str) -> int:
    cfg = compose([f"experiment={experiment}"])
    with torch.device("meta"):  # count without allocating 213M floats
        model = Transformer(ModelConfig(**cfg["model"]), cfg["tokenize"]["vocab_size"])
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts_match_the_paper():
    assert compose(["experiment=wmt14_en_de_base"])["tokenize"]["vocab_size"] == 37000
    base, big = parameter_count("wmt14_en_de_base"), parameter_count("wmt14_en_de_big")
    assert abs(base - 65e6) / 65e6 < 0.03, base  # Table 3: 65M
    assert abs(big - 213e6) / 213e6 < 0.03, big  # Table 3: 213M


def test_initialisation_is_a_standalone_torch_decoder_layers():
    """Q/K/V as nn.MultiheadAttention's stacked in_proj, W^O and the FFN as nn.Linear's default, zero biases:
    the weights of a torch.nn.TransformerDecoderLayer built on its own (nn.Transformer re-draws all of them
    with Xavier)."""
    d, h, d_ff = 256, 4, 1024
    torch.manual_seed(0)
    ours = Transformer(ModelConfig(n_layers=2, d_model=d, d_ff=d_ff, n_heads=h, d_k=d // h, d_v=d // h, dropout=0.0,
                                   positional_encoding="sinusoidal", max_positions=64), 8000)
    ref_layer = torch.nn.TransformerDecoderLayer(d, h, d_ff, batch_first=True)
    layer = ours.decoder[0]
    pairs = [  # (ours, nn.Transformer's) for every kind of matrix
        (layer.self_attn.w_qkv.weight, ref_layer.self_attn.in_proj_weight),
        (torch.cat([layer.cross_attn.w_q.weight, layer.cross_attn.w_kv.weight]), ref_layer.multihead_attn.in_proj_weight),
        (layer.self_attn.w_o.weight, ref_layer.self_attn.out_proj.weight),
        (layer.ffn.w_1.weight, ref_layer.linear1.weight),
        (layer.ffn.w_2.weight, ref_layer.linear2.weight),
    ]
    for mine, theirs in pairs:
        assert mine.shape == theirs.shape
        bound = float(theirs.abs().max())  # uniform: the largest of ~100K draws sits at the bound
        assert float(mine.abs().max()) <= bound * 1.001
        assert float(mine.std()) == pytest.approx(float(theirs.std()), rel=0.02)
    # Xavier on the stacked [3D, D] matrix is narrower than Xavier on each [D, D] block (the old scheme)
    assert float(layer.self_attn.w_qkv.weight.abs().max()) < math.sqrt(6 / (2 * d)) * 0.8
    biases = [p for name, p in ours.named_parameters() if name.endswith("bias") and "norm" not in name]
    assert biases and all(float(b.abs().max()) == 0.0 for b in biases)
    assert float(ours.embedding.weight[1:].std()) == pytest.approx(d**-0.5, rel=0.02)
    assert float(ours.embedding.weight[0].abs().max()) == 0.0  # the padding row


def test_activation_dropout_drops_the_feed_forwards_hidden_units_in_training_only():
    """model.activation_dropout p: in training, each hidden unit max(0, x W1 + b1) of every feed-forward is zeroed
    with probability p and the rest scaled by 1 / (1 - p); in eval mode, none. At 0 (the paper, and what a
    checkpoint's model_config without the key means) the feed-forward draws nothing from the RNG."""
    model = tiny_model(d_ff=512, activation_dropout=0.25).train()
    ffn = model.encoder[0].ffn
    seen = []
    ffn.w_2.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    x = torch.randn(4, 30, 16)
    hidden = F.relu(ffn.w_1(x)).detach()
    ffn(x)
    kept = seen[-1][hidden > 0] / hidden[hidden > 0]
    dropped = kept == 0
    assert torch.allclose(kept[~dropped], torch.tensor(1 / 0.75))
    assert dropped.float().mean().item() == pytest.approx(0.25, abs=0.02)
    ffn.eval()
    ffn(x)
    assert torch.equal(seen[-1], hidden)

    plain = tiny_model(d_ff=512).train()
    assert plain.encoder[0].ffn.activation_dropout.__class__ is torch.nn.Identity
    before = torch.get_rng_state()
    plain.encoder[0].ffn(x)
    assert torch.equal(torch.get_rng_state(), before)
    assert ModelConfig(**TINY).activation_dropout == 0.0
    assert ModelConfig(**TINY).shape() == ModelConfig(**TINY, activation_dropout=0.3).shape()
