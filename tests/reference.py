"""An independent reference: one full forward pass with the model's own `forward`."""

from __future__ import annotations

import torch


@torch.inference_mode()
def full_logprobs(model, token_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """log_softmax of the logits at every position of one uncached forward: [len, V]."""
    logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
