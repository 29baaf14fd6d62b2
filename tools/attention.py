"""Pictures of the encoder-decoder attention: one heat map per head of the last decoder layer.

    python -m tools.attention --model data/model --tokenized data/tokenized --raw data/raw --out reports/attention [--n 3] [--params params.yaml]

Not a DVC stage. Takes the first `n` test sentences of 5 to 30 pieces (longer
ones make unreadable pictures), translates them as the translate stage does
(beam search, params `translate`), then feeds BOS + the translation back
through the decoder and draws, for every head of the last decoder layer, the
attention each output piece paid to each source piece when it was predicted
(Transformer.cross_attention_weights): source pieces along x, output pieces
along y, one subplot per head, in the manner of the paper's appendix figures.
Writes reports/attention/test_{line}.png (the directory is replaced whole).
"""

from __future__ import annotations

import io
import logging
import math

import numpy as np
import sentencepiece as spm
import torch
from matplotlib.figure import Figure

from model.transformer import Transformer
from pipeline.core import cli, config
from pipeline.core.config import TranslateConfig
from pipeline.weights.checkpoint import load_model
from pipeline.corpus.formats import BOS_ID, EOS_ID, Ragged, load_spm, load_split, read_meta
from pipeline.core.files import atomic_dir, write_bytes
from pipeline.translation.decoding import translate_ids

log = logging.getLogger(__name__)

READABLE = (5, 30)  # source lengths in pieces that make a legible picture


def pick_sentences(sources: Ragged, n: int) -> list[int]:
    """The first n sentences of readable length, topped up with the first others if too few are."""
    lengths = sources.lengths
    readable = [i for i in range(len(sources)) if READABLE[0] <= lengths[i] <= READABLE[1]][:n]
    others = [i for i in range(len(sources)) if i not in set(readable)]
    return sorted((readable + others)[:n])


def cross_attention(model: Transformer, src_ids: list[int], out_ids: list[int]) -> np.ndarray:
    """Attention of the last decoder layer, [H, T + 1, S + 1]: row t predicts out_ids[t] (then EOS)."""
    src = torch.tensor([src_ids + [EOS_ID]])  # [1, S + 1]
    tgt_in = torch.tensor([[BOS_ID] + out_ids])  # [1, T + 1]
    with torch.inference_mode():
        return model.cross_attention_weights(src, tgt_in)[0].float().numpy()


def plot_heads(weights: np.ndarray, src_pieces: list[str], out_pieces: list[str], title: str) -> bytes:
    """PNG with one heat map per head (weights [H, T, S]), source pieces on x and output pieces on y."""
    H, T, S = weights.shape
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    width, height = max(3.0, 0.22 * S + 1.2), max(2.5, 0.22 * T + 1.0)
    fig = Figure(figsize=(cols * width + 1.0, rows * height + 0.8), dpi=110, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = float(weights.max())  # one scale for all heads, so they compare
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.set_axis_off()
            continue
        image = ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(S), src_pieces, rotation=90, fontsize=7)
        ax.set_yticks(range(T), out_pieces, fontsize=7)
        ax.set_title(f"head {h + 1}", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(title, fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def pieces(sp: spm.SentencePieceProcessor, ids: list[int]) -> list[str]:
    """Axis labels: the sentencepiece pieces of `ids`, then EOS."""
    return [sp.id_to_piece(i) for i in ids] + ["</s>"]


def draw(model: Transformer, sp: spm.SentencePieceProcessor, src_ids: list[int], out_ids: list[int],
         source: str) -> bytes:
    """The picture of one sentence and its translation."""
    weights = cross_attention(model, src_ids, out_ids)
    title = f"encoder-decoder attention, last decoder layer\nsource: {source}\noutput: {sp.decode(out_ids)}"
    return plot_heads(weights, pieces(sp, src_ids), pieces(sp, out_ids), title)


def main(argv: list[str] | None = None) -> None:
    parser = cli.stage_parser(__doc__, "model", "tokenized", "raw", "out")
    parser.add_argument("--n", type=int, default=3, help="number of test sentences to draw")
    args = parser.parse_args(argv)
    cli.setup_logging()
    cfg = config.load(args.params, "translate", TranslateConfig)
    model = load_model(args.model, torch.device("cpu"))
    sp = load_spm(args.tokenized, model.embedding.num_embeddings)
    src_lang = read_meta(args.tokenized)["src_lang"]
    sources = load_split(args.tokenized, "test", src_lang)
    raw_lines = (args.raw / f"test.{src_lang}").read_text(encoding="utf-8").split("\n")
    chosen = pick_sentences(sources, args.n)
    src_ids = [sources[i].astype(np.int64).tolist() for i in chosen]
    outputs = translate_ids(model, [np.asarray(ids) for ids in src_ids], cfg, progress=False)
    with atomic_dir(args.out) as tmp:
        for i, ids, out_ids in zip(chosen, src_ids, outputs):
            write_bytes(tmp / f"test_{i + 1}.png", draw(model, sp, ids, out_ids, raw_lines[i]))
    log.info("wrote %d picture(s) to %s (test lines %s)", len(chosen), args.out, [i + 1 for i in chosen])


if __name__ == "__main__":
    cli.run(main)
