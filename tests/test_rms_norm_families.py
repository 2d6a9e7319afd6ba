"""transformers' RMSNorm classes (ARCHITECTURE.md §2.3): recognized by what their forward
computes, exact on tiny Llama, Qwen2 and Mistral decoders (float64, padding), and refused by
name when a look-alike computes something else."""

import pytest
import torch
from oracles import LAYOUTS, assert_exact_clipping_all_and_none, causal_lm_losses, padded_tokens
from torch import nn

from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError
from raydp_train.privacy.rms_norm_families import RMSNormFamilyRule
from raydp_train.privacy.rule_registry import rule_for

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")

pytestmark = pytest.mark.usefixtures("float64")

VOCAB = 50
# These RMSNorm classes compute in float32 even in a float64 model; the rule computes their
# formula in float64, so per-example norms agree to float32 rounding, not to 1e-9.
NORM_RTOL = 1e-6
TINY = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}
# Qwen2 with its LM head tied to the embedding, as Qwen2-0.5B ships.
DECODERS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
            "mistral": ("MistralConfig", "MistralForCausalLM", {})}


def tiny_decoder(kind: str) -> nn.Module:
    config_class, model_class, extra = DECODERS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**TINY, **extra)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_class)(config).double()
    with torch.no_grad():  # RMSNorm weights start at ones: make each example's gradient generic
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_(1.0, 0.3)
    return model


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(DECODERS))
def test_decoder_with_its_rms_norm_class_matches_naive_loop(kind, layout):
    model = tiny_decoder(kind)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(type(rule_for(m)) is RMSNormFamilyRule for m in norms)
    inputs = padded_tokens(*LAYOUTS[layout], VOCAB)
    assert_exact_clipping_all_and_none(model, causal_lm_losses, inputs, NORM_RTOL)


def test_rms_norm_weights_alone_match_naive_loop():
    """Only the RMSNorm weights trained: their per-example gradients are the whole norm."""
    model = tiny_decoder("llama")
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    inputs = padded_tokens(*LAYOUTS["padded"], VOCAB)
    assert_exact_clipping_all_and_none(model, causal_lm_losses, inputs, NORM_RTOL)


class EpsilonOutsideTheRoot(nn.Module):
    """Looks like an RMSNorm, but computes weight * x / (rms(x) + eps)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), 1e-6

    def forward(self, x):
        return self.weight * x / (x.square().mean(-1, keepdim=True).sqrt() + self.eps)


class WeightIgnored(EpsilonOutsideTheRoot):
    """Right formula, but the weight is never applied: equal to an RMSNorm at init only."""

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)


@pytest.mark.parametrize("look_alike", [EpsilonOutsideTheRoot, WeightIgnored,
                                        transformers.models.gemma.modeling_gemma.GemmaRMSNorm])
def test_a_look_alike_that_computes_something_else_is_refused_by_name(look_alike):
    """With privacy.other_layers: refuse; on the per-example path it is exact instead."""
    model = nn.Sequential(nn.Linear(16, 16), look_alike(16))
    with pytest.raises(UnsupportedLayerError,
                       match=rf"module '1' \({look_alike.__name__}\).*supported: .*RMSNorm classes"):
        PerExampleClipper(model, 1.0, other_layers="refuse")
    assert not any(type(rule) is RMSNormFamilyRule
                   for _, _, rule in PerExampleClipper(model, 1.0).layers)


class GainedNorm(nn.Module):
    """An RMSNorm whose instances carry a gain of their own: one class, two computations."""

    def __init__(self, hidden: int, gain: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon, self.gain = 1e-6, gain

    def forward(self, x):
        scale = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon)
        return self.gain * self.weight * x * scale


def test_each_instance_is_checked_on_its_own():
    """The class's first instance computes RMSNorm; a later one with another gain does not,
    and must not inherit the first one's verdict."""
    assert type(rule_for(GainedNorm(8))) is RMSNormFamilyRule
    assert rule_for(GainedNorm(8, gain=2.0)) is None
    model = nn.Sequential(nn.Linear(8, 8), GainedNorm(8), GainedNorm(8, gain=2.0))
    with pytest.raises(UnsupportedLayerError, match=r"module '2' \(GainedNorm\)"):
        PerExampleClipper(model, 1.0, other_layers="refuse")
