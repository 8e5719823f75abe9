"""The model's options and the mixture-of-experts options."""

from __future__ import annotations

from dataclasses import dataclass

from reference_impl.options.base import Options, at_least, check_choices, fail, finite_non_negative
from reference_impl.options.capabilities import MODEL_CAPABILITIES, ModelCapabilities, ModelName


@dataclass(frozen=True)
class ModelOptions(Options):
    """Which model to train and its shape."""

    model: ModelName = "mlp"
    """Which synthetic task and model to train."""
    input_dim: int = 32
    """MLP: input features."""
    hidden_dim: int = 128
    """MLP hidden width and transformer MLP width."""
    num_classes: int = 10
    """MLP: output classes."""
    vocab_size: int = 64
    """Transformer: vocabulary size."""
    seq_len: int = 32
    """Transformer: tokens per training sequence."""
    d_model: int = 64
    """Transformer: residual stream width."""
    n_layers: int = 2
    """Transformer: number of blocks (the units FSDP shards and checkpointing recomputes)."""
    n_heads: int = 4
    """Transformer: attention heads; must divide d_model."""
    dropout: float = 0.0
    """Transformer: dropout probability (exercises RNG state on resume)."""

    @property
    def capabilities(self) -> ModelCapabilities:
        """What the configured model can run with."""
        return MODEL_CAPABILITIES[self.model]

    def validate(self) -> None:
        """Positive sizes, a dropout probability, and heads that divide the width."""
        check_choices(self, ModelOptions)
        at_least(self, 1, "input_dim", "hidden_dim", "num_classes", "vocab_size", "seq_len", "d_model",
                 "n_layers", "n_heads")
        if not 0.0 <= self.dropout < 1.0:
            fail(f"dropout must be in [0, 1) (got {self.dropout})")
        if self.d_model % self.n_heads:
            fail(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")


@dataclass(frozen=True)
class ExpertOptions(Options):
    """Mixture-of-experts blocks (their expert-parallel degree is a parallelism option)."""

    n_experts: int = 0
    """Transformer: with E > 0 every block's MLP is a mixture of E experts (top-2 routing, top-1
    with one expert; capacity factor 1.25: a token over an expert's capacity skips it)."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (n_experts x sum_i f_i x P_i per block) added to the
    training loss when n_experts > 0."""

    def validate(self) -> None:
        """A count of experts and a non-negative loss weight."""
        at_least(self, 0, "n_experts")
        finite_non_negative(self, "moe_aux_loss_coef")
