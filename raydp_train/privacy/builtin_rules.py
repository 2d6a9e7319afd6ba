"""The built-in layer rules: importing this module registers them (ARCHITECTURE.md §2.3;
lora: DP-LoRA's adapter layers)."""

from raydp_train.privacy import (  # noqa: F401
    attention_rule,
    conv_rules,
    embedding_rule,
    layer_rules,
    lora,
    lstm_rule,
    norm_rules,
    prelu_rule,
    rms_norm_families,
)
