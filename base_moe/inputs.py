"""The token inputs of calibration and evaluation: the checks both run on the ids they are given, and the model's
context, past which both warn."""

from __future__ import annotations

import warnings

import torch

__all__ = ["check_token_ids", "context_length", "vocab_size", "warn_past_context"]


def vocab_size(model: torch.nn.Module) -> int | None:
    """The model's vocabulary size (its config's ``vocab_size``), where it says."""
    return _positive_int(getattr(_text_config(model), "vocab_size", None))


def context_length(model: torch.nn.Module) -> int | None:
    """The model's context (its text config's ``max_position_embeddings``), where it says."""
    return _positive_int(getattr(_text_config(model), "max_position_embeddings", None))


def check_token_ids(ids: torch.Tensor, vocab: int | None) -> None:
    """Raises ``TypeError`` unless ``ids`` hold integers and ``ValueError`` unless every id is in ``[0, vocab)``
    (``vocab`` None: only ``>= 0``), naming the ids' range: the embedding's own error names no id, and float ids
    would be truncated without a word."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise ValueError(f"input_ids must be token ids in [0, {vocab or 'vocabulary size'}), got ids from {low} to "
                         f"{high}")


def warn_past_context(model: torch.nn.Module, seq: int, stacklevel: int = 2) -> None:
    """Warns when sequences of ``seq`` tokens run past the model's context."""
    context = context_length(model)
    if context is not None and seq > context:
        warnings.warn(f"seq={seq} is longer than the model's context (max_position_embeddings {context}): positions "
                      "past it are off the model's distribution, and every figure of the run with them",
                      stacklevel=stacklevel + 1)


def _text_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
