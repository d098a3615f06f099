"""Small real datasets that ship inside installed packages (no download at run time)."""

from __future__ import annotations

from typing import Tuple

import torch


def digits(train_size: int = 1500) -> Tuple[torch.utils.data.TensorDataset, Tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's 8x8 handwritten digits (1797 images): a train ``TensorDataset`` of
    the first ``train_size`` and the rest as a held-out ``(x, y)`` pair."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    return torch.utils.data.TensorDataset(x[:train_size], y[:train_size]), (x[train_size:], y[train_size:])
