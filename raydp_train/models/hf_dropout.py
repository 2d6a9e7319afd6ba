"""`model.dropout`: one dropout probability for a whole Hugging Face model.

Each architecture names its own (BERT `hidden_dropout_prob`, GPT-2 `attn_pdrop`, Llama
`attention_dropout`), and some layers keep the number rather than a torch Dropout module, so
every number in the config whose name says dropout is set before the model is built, then
every Dropout module it built (e.g. a head whose rate the checkpoint fixed)."""

from __future__ import annotations

from torch import nn


def dropout_options(hf_config, probability: float | None) -> dict[str, float]:
    """The config values to set for `probability` (none when it is None)."""
    if probability is None:
        return {}
    return {key: probability for key, value in hf_config.to_dict().items()
            if ("dropout" in key or key.endswith("pdrop"))
            and isinstance(value, (int, float)) and not isinstance(value, bool)}


def set_dropout_modules(model: nn.Module, probability: float | None) -> None:
    """Every torch Dropout module of `model` at `probability` (unchanged when None)."""
    if probability is None:
        return
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = probability
