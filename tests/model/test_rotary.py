"""Rotary positions (model.positional_encoding=rotary, model/positions.py's Rotary): queries and keys of
self-attention turned by their positions' angles, nothing added to the embeddings."""

import math

import pytest
import torch

from model.config import ModelConfig
from model.positions import Rotary
from model.transformer import Transformer

V = 40
TINY = dict(n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=6, dropout=0.0,
            positional_encoding="rotary", max_positions=64)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**TINY, **overrides}), V).eval()


@pytest.mark.parametrize("base", [10000, 1000, 100])
def test_rotary_turns_each_pair_of_a_head_by_its_positions_angle(base):
    d_k, heads, start = 8, 3, 5
    x = torch.randn(2, 4, heads * d_k)
    out = Rotary(d_k, 64, base)(x, start)
    for b, pos, h, i in [(0, 0, 0, 0), (1, 3, 2, 3), (0, 2, 1, 1), (1, 1, 0, 2)]:
        angle = (start + pos) / base ** (2 * i / d_k)
        pair = complex(*x[b, pos, h * d_k + 2 * i : h * d_k + 2 * i + 2].tolist())
        turned = pair * complex(math.cos(angle), math.sin(angle))
        got = out[b, pos, h * d_k + 2 * i : h * d_k + 2 * i + 2].tolist()
        assert got == pytest.approx([turned.real, turned.imag], abs=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation: lengths kept


def test_self_attention_scores_depend_on_positions_only_through_their_distance():
    attention = tiny_model().encoder[0].self_attn
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        q0, k0, v0 = attention.project_qkv(x, start=0)
        q9, k9, v9 = attention.project_qkv(x, start=9)
    assert (q0 - q9).abs().max() > 0.1  # the queries themselves move with the position
    torch.testing.assert_close(q0 @ k0.transpose(-1, -2), q9 @ k9.transpose(-1, -2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v0, v9)


def test_rotary_adds_nothing_to_the_embeddings_and_keeps_the_checkpoint_format():
    model = tiny_model()
    src = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model.embed(src), model.embedding.weight[src] * math.sqrt(16))
    sinusoidal = tiny_model(positional_encoding="sinusoidal")
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in sinusoidal.state_dict().items()}


def test_the_encoder_sees_the_order_of_the_source():
    model = tiny_model()
    src = torch.tensor([[4, 5, 6, 7, 8]])
    with torch.no_grad():
        memory, _ = model.encode(src)
        reversed_memory, _ = model.encode(src.flip(1))
    # Without positions, self-attention is order-blind: the reversed source's states would be the same, reversed.
    assert (reversed_memory.flip(1) - memory).abs().max() > 1e-2


def test_model_rotary_base_sets_the_angles_of_every_self_attention_and_nothing_else():
    default, small_base = tiny_model(), tiny_model(rotary_base=100)
    assert ModelConfig(**TINY).rotary_base == 10000  # the sinusoids' base when absent, as in older checkpoints
    torch.testing.assert_close(default.rotary.sin, Rotary(8, 64).sin)
    torch.testing.assert_close(small_base.rotary.sin, Rotary(8, 64, 100).sin)
    assert all(layer.self_attn.rotary is small_base.rotary for layer in [*small_base.encoder, *small_base.decoder])
    assert ModelConfig(**TINY).shape() == ModelConfig(**TINY, rotary_base=100).shape()  # same parameters and FLOPs
    # Same weights (same seed), other angles: the encoder's states differ.
    src = torch.tensor([[4, 5, 6, 7, 8]])
    with torch.no_grad():
        assert (default.encode(src)[0] - small_base.encode(src)[0]).abs().max() > 1e-3


def test_model_rotary_base_is_refused_without_rotary_positions():
    with pytest.raises(ValueError, match="model.rotary_base: used by positional_encoding rotary only, got 1000 with "
                                         "positional_encoding sinusoidal"):
        tiny_model(positional_encoding="sinusoidal", rotary_base=1000)
    tiny_model(positional_encoding="sinusoidal", rotary_base=10000)  # the default value is no choice


def test_rotary_needs_an_even_d_k_and_a_known_name():
    with pytest.raises(ValueError, match="model.d_k must be even, got 7"):
        tiny_model(d_k=7)
    with pytest.raises(ValueError, match="model.positional_encoding: expected one of sinusoidal, learned, rotary"):
        tiny_model(positional_encoding="relative")


def test_rotary_turns_as_complex_numbers_in_fp32_or_fp64_and_compiled_graphs_pair_by_pair(monkeypatch):
    rotary, start, d_k = Rotary(8, 64, 1000), 3, 8
    x = torch.randn(2, 6, 3 * d_k, dtype=torch.float64)
    grad_out = torch.randn_like(x)
    assert torch.autograd.gradcheck(lambda t: rotary(t, start), (x.clone().requires_grad_(),))  # complex numbers
    # The gradient of a turn is the same turn backwards: (g_even, g_odd) turned by minus the angle.
    g_even, g_odd = grad_out.unflatten(-1, (-1, d_k // 2, 2)).unbind(-1)
    sin, cos = rotary.sin[start : start + 6, None].double(), rotary.cos[start : start + 6, None].double()
    turned_back = torch.stack((g_even * cos + g_odd * sin, g_odd * cos - g_even * sin), dim=-1).flatten(2)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        turned = x.to(dtype).detach().requires_grad_()
        out = rotary(turned, start)
        assert out.dtype == dtype and out.shape == x.shape
        out.backward(grad_out.to(dtype))
        torch.testing.assert_close(out.double(), rotary(x, start), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(turned.grad.double(), turned_back, rtol=tolerance, atol=tolerance)
    # A CPU's bf16 (autocast's products) turns in fp32, rounded once: the fp32 turn of the same bf16 numbers.
    x16 = x.bfloat16()
    assert torch.equal(rotary(x16, start), rotary(x16.float(), start).bfloat16())
    # Compiled graphs turn pair by pair: in fp32 the same numbers; in bf16 each real product rounded, further off.
    x32 = x.float()
    complex_turn, bf16_turn = rotary(x32, start), rotary(x16, start)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(rotary(x32, start), complex_turn, rtol=1e-6, atol=1e-6)
    wide = torch.randn(8, 16, 3 * d_k, generator=torch.Generator().manual_seed(0)).bfloat16()
    pair_by_pair, exact = rotary(wide, start), rotary(wide.double(), start)
    monkeypatch.undo()
    error = {name: float((turn.double() - exact).abs().mean()) for name, turn in
             (("pair by pair", pair_by_pair), ("fp32", rotary(wide, start)))}
    assert error["pair by pair"] > 1.3 * error["fp32"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rotary_model_cast_for_decoding_turns_as_before(dtype):
    model = tiny_model()  # the translate stage casts the model to its decoding precision (fp32 on a CPU)
    src = torch.tensor([[4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model.encode(src)[0].double()
        model.to(dtype)
        torch.testing.assert_close(model.encode(src)[0].double(), before, rtol=1e-5, atol=1e-5)
