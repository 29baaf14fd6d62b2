"""The model's shape, written once: the `model` params section as one frozen dataclass.

Built once from params (pipeline.config.load(path, "model", ModelConfig)) and
passed as one object to the model, the FLOPs count, tracking and the benchmarks.
The vocabulary size is not here: it is the tokenize stage's output
(data/tokenized/meta.json), passed beside the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int  # N, in each of the encoder and decoder stacks (Sec. 3.1)
    d_model: int
    d_ff: int  # inner dimension of the feed-forward networks (Sec. 3.3)
    n_heads: int  # h (Sec. 3.2.2)
    d_k: int
    d_v: int
    dropout: float  # P_drop (Sec. 5.4)
    positional_encoding: str  # "sinusoidal" (Sec. 3.5) or "learned" (Table 3 row E)
    max_positions: int  # longest sequence the positional encoding covers

    def shape(self) -> dict[str, int]:
        """The fields that set the parameter count and the FLOPs (Table 3's size columns)."""
        return {k: v for k, v in asdict(self).items() if k not in ("dropout", "positional_encoding", "max_positions")}
