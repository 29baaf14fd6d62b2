"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017), Sec. 3.

Read in the paper's order: attention (3.2), feed-forward (3.3), embeddings and
softmax (3.4), then the encoder and decoder stacks
(3.1) and the model that joins them; positional encoding (3.5) is in model/positions.py.
Post-norm residual blocks, LayerNorm(x + Dropout(Sublayer(x))), everywhere.

Dimensions: B batch, S source length, T target length, D d_model, H heads,
V vocabulary. Token id `pad_id` marks padding (pipeline.corpus.formats.PAD_ID). The shape comes
from one ModelConfig (model/config.py): Transformer(cfg, vocab_size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import POSITIONAL_ENCODINGS, ModelConfig
from model.dropout import Dropout
from model.positions import Rotary, sinusoidal_encoding

# --- 3.2 Attention -------------------------------------------------------------


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """[B, S] token ids -> [B, 1, 1, S] boolean mask, True where a key may be attended."""
    return (tokens != pad_id)[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention, Sec. 3.2.2.

    The per-head projections W^Q_i, W^K_i, W^V_i are stored side by side in one
    matrix (one matrix product instead of 3h); for self-attention the three are
    fused further into a single [D, H*(2*d_k + d_v)] product.
    """

    def __init__(self, d_model: int, n_heads: int, d_k: int, d_v: int, self_attention: bool,
                 rotary: Rotary | None = None):
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.self_attention, self.rotary = self_attention, rotary
        # Paper: W^Q, W^K, W^V and W^O are plain matrices (Sec. 3.2.2; tensor2tensor has no biases
        # there either). These nn.Linear carry biases, initialised to zero: 4 x d_model more
        # parameters per attention (37K in base), kept because the default's results were measured so.
        if self_attention:
            self.w_qkv = nn.Linear(d_model, n_heads * (2 * d_k + d_v))
        else:
            self.w_q = nn.Linear(d_model, n_heads * d_k)
            self.w_kv = nn.Linear(d_model, n_heads * (d_k + d_v))
        self.w_o = nn.Linear(n_heads * d_v, d_model)

    def _heads(self, x: Tensor, d: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, d).transpose(1, 2)  # [B, L, H*d] -> [B, H, L, d]

    def project_q(self, x: Tensor) -> Tensor:
        """Queries of `x` for cross-attention: [B, T, D] -> [B, H, T, d_k]."""
        return self._heads(self.w_q(x), self.d_k)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output for cross-attention: [B, H, S, d_k], [B, H, S, d_v]."""
        k, v = self.w_kv(memory).split([self.n_heads * self.d_k, self.n_heads * self.d_v], dim=-1)
        return self._heads(k, self.d_k), self._heads(v, self.d_v)

    def project_qkv(self, x: Tensor, start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of `x` for self-attention, each [B, H, L, d]; with rotary positions, the
        queries and keys turned by the angles of positions start..start+L-1."""
        h = self.n_heads
        qk, v = self.w_qkv(x).split([2 * h * self.d_k, h * self.d_v], dim=-1)
        if self.rotary is not None:
            qk = self.rotary(qk, start)
        q, k = qk.split(h * self.d_k, dim=-1)
        return self._heads(q, self.d_k), self._heads(k, self.d_k), self._heads(v, self.d_v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """softmax(Q K^T / sqrt(d_k)) V over heads, then W^O. q [B,H,T,d_k] -> [B, T, D]."""
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal))

    def attend_products(self, q: Tensor, k_t: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
        """softmax(Q K^T / sqrt(d_k) + bias) V as two products, which beat the fused kernel on CPUs for the few
        queries of a decoding step. q [B,H,T,d_k], k_t = K^T [B,H,d_k,S], bias [B,1,1,S] or None -> [B,H,T,d_v]."""
        scores = q @ k_t / math.sqrt(self.d_k)
        return torch.softmax(scores if bias is None else scores + bias, dim=-1) @ v

    def merge(self, out: Tensor) -> Tensor:
        """W^O over the concatenated heads: [B, H, T, d_v] -> [B, T, D]."""
        B, _, T, _ = out.shape
        return self.w_o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.d_v))

    def forward(self, x: Tensor, mask: Tensor | None, causal: bool = False, memory: Tensor | None = None) -> Tensor:
        """Self-attention over `x` ([B, L, D]), or cross-attention from `x` to `memory` ([B, S, D])."""
        if self.self_attention:
            q, k, v = self.project_qkv(x)
        else:
            q = self.project_q(x)
            k, v = self.project_kv(memory)
        return self.attend(q, k, v, mask, causal)

    def weights(self, x: Tensor, memory: Tensor, mask: Tensor) -> Tensor:
        """The attention distribution itself (for pictures), [B, H, T, S]."""
        q = self.project_q(x)
        k, _ = self.project_kv(memory)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_k)
        return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


# --- 3.3 Position-wise feed-forward networks ------------------------------------


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, Eq. 2; with `activation_dropout` > 0 (not in the paper), dropout on
    max(0, x W1 + b1) in training. At 0 there is no dropout module at all: no mask, no draw from the RNG."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation_dropout = Dropout(activation_dropout) if activation_dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.activation_dropout(F.relu(self.w_1(x))))


# --- 3.1 Encoder and decoder stacks -------------------------------------------------


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each LayerNorm(x + Dropout(Sublayer(x)))."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, self_attention=True, rotary=rotary)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.norm_1, self.norm_2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.norm_1(x + self.dropout(self.self_attn(x, src_mask)))
        return self.norm_2(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder output, feed-forward; each post-norm."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, self_attention=True, rotary=rotary)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, self_attention=False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.norm_1, self.norm_2, self.norm_3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.dropout = Dropout(cfg.dropout)

    def forward(self, y: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        y = self.norm_1(y + self.dropout(self.self_attn(y, None, causal=True)))
        y = self.norm_2(y + self.dropout(self.cross_attn(y, src_mask, memory=memory)))
        return self.norm_3(y + self.dropout(self.ffn(y)))

    def step(self, y: Tensor, cache: LayerCache, state: DecoderState) -> Tensor:
        """One decoding position with cached keys and values. y [R, 1, D] (one row per hypothesis) -> [R, 1, D]."""
        t = state.position
        q, k, v = self.self_attn.project_qkv(y, start=t)  # [R, H, 1, d]
        cache.grow(t + 1)
        cache.self_k[t], cache.self_v[t] = k[:, :, 0], v[:, :, 0]
        past_k_t = cache.self_k[: t + 1].permute(1, 2, 3, 0)  # [t+1, R, H, d_k] -> [R, H, d_k, t+1]
        past_v = cache.self_v[: t + 1].permute(1, 2, 0, 3)  # [R, H, t+1, d_v]
        y = self.norm_1(y + self.dropout(self.self_attn.merge(self.self_attn.attend_products(q, past_k_t, past_v))))
        # The beams of a sentence share its one copy of the encoder keys and values: their queries go into
        # a [N x K] grid of (sentence, beam) slots and attend as K query positions of that sentence.
        N, K = state.src_bias.shape[0], state.beams
        q = self.cross_attn.project_q(y)[:, :, 0]  # [R, H, d_k]
        grid = q.new_zeros(N * K, *q.shape[1:]).index_copy_(0, state.slots, q).view(N, K, *q.shape[1:])
        out = self.cross_attn.attend_products(grid.transpose(1, 2), cache.cross_k_t, cache.cross_v, state.src_bias)
        out = out.transpose(1, 2).reshape(N * K, 1, -1).index_select(0, state.slots)  # [N, H, K, d_v] -> [R, 1, H*d_v]
        y = self.norm_2(y + self.dropout(self.cross_attn.w_o(out)))
        return self.norm_3(y + self.dropout(self.ffn(y)))


@dataclass
class LayerCache:
    """Keys and values one decoder layer has seen: its own past positions (per hypothesis, position-major so
    that following the beams copies each position once) and the encoder output (per sentence)."""

    self_k: Tensor  # [T, R, H, d_k], positions < DecoderState.position filled; T may be larger
    self_v: Tensor  # [T, R, H, d_v]
    cross_k_t: Tensor  # [N, H, d_k, S]: keys transposed once, for every step's Q K^T
    cross_v: Tensor  # [N, H, S, d_v]

    def grow(self, length: int) -> None:
        """Make room for `length` positions (beam search's select already leaves room for the next one)."""
        if self.self_k.shape[0] < length:
            extra = length - self.self_k.shape[0]
            self.self_k = torch.cat([self.self_k, self.self_k.new_empty(extra, *self.self_k.shape[1:])])
            self.self_v = torch.cat([self.self_v, self.self_v.new_empty(extra, *self.self_v.shape[1:])])


def _follow(past: Tensor, rows: Tensor, length: int) -> Tensor:
    """Rows `rows` of the first `length` positions of a [T, R, ...] cache, copied once into room for length + 1."""
    out = past.new_empty(length + 1, len(rows), *past.shape[2:])
    torch.index_select(past[:length], 1, rows, out=out[:length])
    return out


@dataclass
class DecoderState:
    """Everything incremental decoding carries from one step to the next.

    Rows are hypotheses; sentences are source sentences. Hypothesis r is beam slots[r] % beams of sentence
    slots[r] // beams: a sentence may hold any number of its `beams` slots, none included.
    """

    layers: list[LayerCache]
    src_bias: Tensor  # [N, 1, 1, S]: 0 where a key may be attended, -inf at padding (SDPA adds it to the scores)
    slots: Tensor  # [R] long
    beams: int
    position: int  # positions decoded so far

    def select(self, rows: Tensor, slots: Tensor, sentences: Tensor | None) -> DecoderState:
        """Keep hypotheses `rows` ([R'] indices, repeats allowed) and sentences `sentences` ([N'] indices; None:
        all), new row i in grid slot slots[i] of the kept sentences (e.g. to follow beams, drop finished ones)."""
        t = self.position
        keep = (lambda x: x) if sentences is None else (lambda x: x.index_select(0, sentences))
        layers = [LayerCache(_follow(c.self_k, rows, t), _follow(c.self_v, rows, t), keep(c.cross_k_t), keep(c.cross_v))
                  for c in self.layers]
        return DecoderState(layers, keep(self.src_bias), slots, self.beams, t)


# --- The model ------------------------------------------------------------------------


class Transformer(nn.Module):
    """Encoder-decoder with one embedding matrix shared by both inputs and the output projection (3.4)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int = 0):
        super().__init__()
        if cfg.positional_encoding not in POSITIONAL_ENCODINGS:
            raise ValueError(f"model.positional_encoding: expected one of {', '.join(POSITIONAL_ENCODINGS)}, "
                             f"got {cfg.positional_encoding!r}")
        cfg.check_relations()
        self.cfg, self.d_model, self.pad_id, self.max_positions = cfg, cfg.d_model, pad_id, cfg.max_positions
        self.embedding = nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
        self.learned_pe = self.rotary = None
        if cfg.positional_encoding == "sinusoidal":
            self.register_buffer("pe", sinusoidal_encoding(cfg.max_positions, cfg.d_model), persistent=False)
        elif cfg.positional_encoding == "learned":  # Table 3 row (E)
            self.learned_pe = nn.Embedding(cfg.max_positions, cfg.d_model)
        else:
            self.rotary = Rotary(cfg.d_k, cfg.max_positions, cfg.rotary_base)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, self.rotary) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg, self.rotary) for _ in range(cfg.n_layers))
        self.dropout = Dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W^Q, W^K, W^V Xavier-uniform as one stacked matrix; W^O, W_1, W_2 U(+-1/sqrt(fan_in)); zero biases;
        embeddings N(0, d_model^-0.5).

        # Paper: initialisation is not specified. Attention and feed-forward start as
        # in a torch.nn.TransformerDecoderLayer built on its own (nn.MultiheadAttention's
        # stacked in_proj, nn.Linear's default elsewhere): about half the scale of Xavier
        # on every matrix. On Multi30k it reached valid ppl 49.7 after 0.75M target
        # tokens against 70.8 with Xavier on every matrix
        # (docs/results.md, "Choosing the small model"). Embeddings follow
        # tensor2tensor: scaled by sqrt(d_model) they start with unit variance.
        """
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                h = module.n_heads
                fused = [module.w_qkv] if module.self_attention else [module.w_q, module.w_kv]
                d_in = fused[0].in_features
                bound = math.sqrt(6.0 / (d_in + h * (2 * module.d_k + module.d_v)))  # Xavier of the stacked matrix
                for linear in fused:
                    nn.init.uniform_(linear.weight, -bound, bound)
                    nn.init.zeros_(linear.bias)
                linears = [module.w_o]
            elif isinstance(module, FeedForward):
                linears = [module.w_1, module.w_2]
            else:
                continue
            for linear in linears:
                bound = 1.0 / math.sqrt(linear.in_features)
                nn.init.uniform_(linear.weight, -bound, bound)
                nn.init.zeros_(linear.bias)
        nn.init.normal_(self.embedding.weight, std=self.d_model**-0.5)
        with torch.no_grad():
            self.embedding.weight[self.pad_id].zero_()

    def positions(self, start: int, length: int) -> Tensor | None:
        """Positional encodings of positions start..start+length-1, [length, D]; None with rotary positions,
        which turn queries and keys in self-attention instead."""
        if start + length > self.max_positions:
            raise ValueError(f"sequence of {start + length} positions exceeds model.max_positions={self.max_positions}")
        if self.learned_pe is not None:
            return self.learned_pe.weight[start : start + length]
        if self.rotary is not None:
            return None
        return self.pe[start : start + length]  # Paper: sinusoids have no last position; ours stop at max_positions

    def embed(self, tokens: Tensor, start: int = 0) -> Tensor:
        """Shared embedding x sqrt(d_model) plus positional encoding, then dropout (3.4, 3.5, 5.4)."""
        x = self.embedding(tokens) * math.sqrt(self.d_model)
        pe = self.positions(start, tokens.shape[1])
        return self.dropout(x if pe is None else x + pe)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src [B, S] -> (memory [B, S, D], src_mask [B, 1, 1, S])."""
        src_mask = padding_mask(src, self.pad_id)
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return x, src_mask

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher-forced decoder: tgt_in [B, T] (BOS first) -> hidden states [B, T, D].

        Future positions are masked (causal), so padding at the end of a target
        never reaches the positions before it.
        """
        y = self.embed(tgt_in)
        for layer in self.decoder:
            y = layer(y, memory, src_mask)
        return y

    def project(self, hidden: Tensor) -> Tensor:
        """Pre-softmax linear transformation with the shared embedding matrix: [..., D] -> [..., V]."""
        return hidden @ self.embedding.weight.t()

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Logits of the next target token at every position: [B, T, V]."""
        memory, src_mask = self.encode(src)
        return self.project(self.decode(tgt_in, memory, src_mask))

    # --- incremental decoding (translate stage) ---

    def init_state(self, memory: Tensor, src_mask: Tensor, beams: int = 1) -> DecoderState:
        """Project the encoder output once per layer for cross-attention; one empty hypothesis per sentence, in
        slot 0 of its `beams`."""
        layers = []
        B = memory.shape[0]
        for layer in self.decoder:
            k, v = layer.cross_attn.project_kv(memory)
            H = k.shape[1]
            empty_k = k.new_empty(1, B, H, layer.self_attn.d_k)  # room for the first position
            empty_v = v.new_empty(1, B, H, layer.self_attn.d_v)
            layers.append(LayerCache(empty_k, empty_v, k.transpose(-1, -2).contiguous(), v.contiguous()))
        slots = torch.arange(B, device=memory.device) * beams
        src_bias = torch.zeros(src_mask.shape, dtype=memory.dtype, device=memory.device).masked_fill(~src_mask, float("-inf"))
        return DecoderState(layers, src_bias, slots, beams, 0)

    def decode_step(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Feed the last token of each hypothesis, tokens [R]; return next-token logits [R, V] and the grown state."""
        y = self.embed(tokens[:, None], start=state.position)  # [R, 1, D]
        for layer, cache in zip(self.decoder, state.layers):
            y = layer.step(y, cache, state)
        state.position += 1
        return self.project(y[:, 0]), state

    def cross_attention_weights(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Encoder-decoder attention of each head in the last decoder layer, [B, H, T, S]."""
        memory, src_mask = self.encode(src)
        y = self.embed(tgt_in)
        for layer in self.decoder[:-1]:
            y = layer(y, memory, src_mask)
        last = self.decoder[-1]
        y = last.norm_1(y + last.self_attn(y, None, causal=True))
        return last.cross_attn.weights(y, memory, src_mask)

