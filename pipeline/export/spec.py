"""The averaged Transformer as a CTranslate2 model: every weight mapped by name, nothing approximated.

    write_ctranslate2(model, tokenized, out, quantization, about)   # model.bin, vocabularies, spm.model, seal.sha256

CTranslate2's TransformerSpec (post-norm, ReLU, embeddings scaled by sqrt(d_model)) holds the project's model
(model/transformer.py) weight for weight:

    embedding.weight                   encoder.embeddings, decoder.embeddings and decoder.projection (one array,
                                       stored once: the model ties them, Sec. 3.4)
    sinusoidal / learned positions     {encoder,decoder}.position_encodings.encodings, the model's own table
    rotary positions                   rotary_dim 0 (every pair of a head), rotary_interleave (pairs 2i, 2i+1),
                                       rotary_base = model.rotary_base, in self-attention only, as the model
    {encoder,decoder}.i.self_attn      .self_attention: linear[0] = w_qkv (Q, K, V stacked), linear[1] = w_o,
                                       layer_norm = norm_1 (after the residual: post-norm)
    decoder.i.cross_attn               .attention: linear[0] = w_q, linear[1] = w_kv, linear[2] = w_o; norm_2
    {encoder,decoder}.i.ffn            .ffn: linear_0 = w_1, linear_1 = w_2; norm_2 (encoder), norm_3 (decoder)

LayerNorm's epsilon is torch's 1e-5; heads of d_k != d_model / n_heads set CTranslate2's head_dim. A shape
CTranslate2 cannot hold is refused (ExportError, one line naming the setting): heads whose keys and values differ in
size (model.d_v != model.d_k).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from model.transformer import Transformer
from pipeline.core.errors import PipelineError
from pipeline.corpus.formats import BOS_ID, EOS_ID, UNK_ID, load_spm
from pipeline.translation.engine import SPM_NAME
from pipeline.export.seal import seal

LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's


class ExportError(PipelineError):
    """The model cannot be exported, or its export does not decode as the model does; the message says why."""


def check_exportable(model: Transformer) -> None:
    """Refuse, with one line naming the setting, a model CTranslate2's TransformerSpec cannot hold exactly."""
    cfg = model.cfg
    if cfg.d_k != cfg.d_v:
        raise ExportError(f"model.d_v = {cfg.d_v}: CTranslate2 needs keys and values of one size per head "
                          f"(model.d_k = {cfg.d_k}); this model cannot be exported")


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy().copy()


def _linear(spec, module: torch.nn.Linear) -> None:
    spec.weight, spec.bias = _array(module.weight), _array(module.bias)


def _norm(spec, module: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _array(module.weight), _array(module.bias)


def build_spec(model: Transformer, pieces: list[str]):
    """The model's ctranslate2.specs.TransformerSpec, vocabularies registered (not yet validated or quantised)."""
    from ctranslate2.specs import transformer_spec

    check_exportable(model)
    cfg = model.cfg
    head_dim = None if cfg.n_heads * cfg.d_k == cfg.d_model else cfg.d_k
    rotary = dict(rotary_dim=0, rotary_interleave=True, rotary_base=float(cfg.rotary_base)) if model.rotary else {}
    encoder = transformer_spec.TransformerEncoderSpec(cfg.n_layers, cfg.n_heads, pre_norm=False, head_dim=head_dim,
                                                      **rotary)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.n_layers, cfg.n_heads, pre_norm=False, head_dim=head_dim,
                                                      **rotary)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    embedding = _array(model.embedding.weight)
    encoder.embeddings[0].weight = decoder.embeddings.weight = decoder.projection.weight = embedding
    positions = model.positions(0, cfg.max_positions)
    for side in (encoder, decoder):
        if positions is not None:
            side.position_encodings.encodings = _array(positions)
        elif hasattr(side, "position_encodings"):  # rotary: nothing is added to the embeddings
            delattr(side, "position_encodings")
    for layer_spec, layer in [*zip(encoder.layer, model.encoder), *zip(decoder.layer, model.decoder)]:
        _linear(layer_spec.self_attention.linear[0], layer.self_attn.w_qkv)
        _linear(layer_spec.self_attention.linear[1], layer.self_attn.w_o)
        _norm(layer_spec.self_attention.layer_norm, layer.norm_1)
        ffn_norm = layer.norm_2
        if hasattr(layer, "cross_attn"):  # a decoder layer: its cross-attention, then the feed-forward's norm_3
            _linear(layer_spec.attention.linear[0], layer.cross_attn.w_q)
            _linear(layer_spec.attention.linear[1], layer.cross_attn.w_kv)
            _linear(layer_spec.attention.linear[2], layer.cross_attn.w_o)
            _norm(layer_spec.attention.layer_norm, layer.norm_2)
            ffn_norm = layer.norm_3
        _linear(layer_spec.ffn.linear_0, layer.ffn.w_1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.w_2)
        _norm(layer_spec.ffn.layer_norm, ffn_norm)
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = (pieces[i] for i in (UNK_ID, BOS_ID, EOS_ID))
    spec.config.decoder_start_token = pieces[BOS_ID]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def write_ctranslate2(model: Transformer, tokenized: Path, out: Path, quantization: str, about: dict) -> None:
    """Write the CTranslate2 model of `model` into the directory `out` (made if need be): model.bin, the vocabulary,
    config.json (CTranslate2's, plus `about`: where the model came from), the sentencepiece model, and the seal of
    them all (seal.sha256, pipeline/export/seal.py)."""
    sp = load_spm(tokenized, model.embedding.num_embeddings)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if len(set(pieces)) != len(pieces):
        raise ExportError(f"{tokenized}/spm.model: two pieces share a name; CTranslate2 looks tokens up by name")
    spec = build_spec(model, pieces)
    spec.validate()
    spec.optimize(quantization=None if quantization == "none" else quantization)
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))
    shutil.copyfile(Path(tokenized) / SPM_NAME, out / SPM_NAME)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["project"] = {**about, "max_positions": model.max_positions, "quantization": quantization,
                         "sentencepiece": SPM_NAME}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    seal(out)  # last: an export without its seal is refused by every reader
