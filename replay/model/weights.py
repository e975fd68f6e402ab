"""What the two forwards read of a model: its shape, its weights and its RoPE frequencies.

`ReferenceModel` holds these; the forwards (replay.model.fast's incremental step,
replay.model.dense's batched training pass) take them through this Protocol, so
neither imports the model that calls them.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from replay.model.config import ModelConfig


class ModelWeights(Protocol):
    """A model's shape, weights and RoPE tables (`replay.model.ReferenceModel` is one)."""

    # Read-only members: the model's own are Parameters and a ModuleList (subtypes of what is named).
    @property
    def config(self) -> ModelConfig:
        """The model's shape."""

    @property
    def embed(self) -> Tensor:
        """The token embeddings, [vocab, dim]."""

    @property
    def blocks(self) -> nn.ModuleList:
        """One `replay.model.layers.LayerWeights` per layer."""

    @property
    def final_norm(self) -> Tensor:
        """The last RMSNorm's weight."""

    @property
    def head(self) -> Tensor:
        """The output projection, [vocab, dim]."""

    @property
    def freq_window(self) -> Tensor:
        """RoPE frequencies of the window attention (float64)."""

    @property
    def freq_compress(self) -> Tensor:
        """RoPE frequencies of the compressed rows (float64)."""

    @property
    def device(self) -> torch.device:
        """The device of the weights."""
