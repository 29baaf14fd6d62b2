"""The model's shape, written once: the `model` params section as one frozen dataclass.

Built once from params (pipeline.core.config.load(path, "model", ModelConfig)) and
passed as one object to the model, the FLOPs count, tracking and the benchmarks.
The vocabulary size is not here: it is the tokenize stage's output
(data/tokenized/meta.json), passed beside the config. Each field's metadata
declares its valid values (pipeline/core/config.py checks them at load, naming the key).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

POSITIONAL_ENCODINGS = ("sinusoidal", "learned", "rotary")
SINUSOID_BASE = 10000.0  # the sinusoids' base, pos / 10000^(2i/d_model) (Sec. 3.5)


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int = field(metadata={"range": "[1, inf)"})  # N, in each of the encoder and decoder stacks (Sec. 3.1)
    # even: the sinusoidal encoding pairs a sine and a cosine per frequency (Sec. 3.5)
    d_model: int = field(metadata={"range": "[2, inf)", "multiple_of": 2})
    d_ff: int = field(metadata={"range": "[1, inf)"})  # inner dimension of the feed-forward networks (Sec. 3.3)
    n_heads: int = field(metadata={"range": "[1, inf)"})  # h (Sec. 3.2.2)
    d_k: int = field(metadata={"range": "[1, inf)"})
    d_v: int = field(metadata={"range": "[1, inf)"})
    dropout: float = field(metadata={"range": "[0, 1)"})  # P_drop (Sec. 5.4)
    # "sinusoidal" (Sec. 3.5), "learned" (Table 3 row E) or "rotary" (RoFormer, Su et al. 2021; not in the
    # paper: queries and keys of self-attention turned by their position's angles, nothing added to the embeddings)
    positional_encoding: str = field(metadata={"choices": POSITIONAL_ENCODINGS})
    max_positions: int = field(metadata={"range": "[1, inf)"})  # longest sequence the positional encoding covers
    # Not in the paper (fairseq's activation_dropout): dropout on the feed-forward's hidden max(0, x W1 + b1).
    # 0 (no dropout there, as Sec. 5.4) when absent, as in the checkpoints written before it.
    activation_dropout: float = field(default=0.0, metadata={"range": "[0, 1)"})
    # Not in the paper: the base b of the rotary angles pos / b^(2i/d_k), the sinusoids' 10000 (Sec. 3.5) when absent,
    # as in the checkpoints written before it. Used by positional_encoding "rotary" only.
    rotary_base: float = field(default=SINUSOID_BASE, metadata={"range": "(1, inf)"})

    def check_relations(self) -> None:
        """The rules between fields, checked when params load (naming the file) and when a model is built: a
        ValueError naming the key."""
        if self.positional_encoding != "rotary" and self.rotary_base != SINUSOID_BASE:
            raise ValueError(f"model.rotary_base: used by positional_encoding rotary only, got {self.rotary_base:g} "
                             f"with positional_encoding {self.positional_encoding}: set it back to {SINUSOID_BASE:g} "
                             "or use rotary")
        if self.positional_encoding == "rotary" and self.d_k % 2:
            raise ValueError("model.positional_encoding=rotary turns pairs of a head's dimensions: model.d_k must be "
                             f"even, got {self.d_k}")

    def shape(self) -> dict[str, int]:
        """The fields that set the parameter count and the FLOPs (Table 3's size columns)."""
        not_shape = ("dropout", "activation_dropout", "positional_encoding", "max_positions", "rotary_base")
        return {k: v for k, v in asdict(self).items() if k not in not_shape}
