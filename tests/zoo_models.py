"""A zoo of real architectures in tiny configs (random init, built from code, no downloads),
and the check each must pass: the clipping engine's clipped sum and per-example norms over two
micro-batches equal the naive per-example loop's (float64), at a clip norm where every example
is clipped. tests/test_model_zoo.py and benchmarks/model_zoo.py both read this module.

Every dropout (and drop-path, layer-drop) probability is set to 0 in the config: a module on
the per-example path that draws random numbers is refused (ARCHITECTURE.md §2.3), and the naive
loop would draw other numbers than the engine's pass anyway."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from oracles import (
    clip_and_sum,
    engine_sum_in_parameter_order,
    next_token_losses,
    per_example_grads,
)
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.models.hf import SequenceClassifier
from raydp_train.models.hf_causal import CausalLM
from raydp_train.privacy.clipping import PerExampleClipper

BATCH, TOKENS, VOCAB, CLASSES = 5, 5, 30, 3
LENGTHS = (5, 4, 5, 3, 5)  # text examples, right padded to TOKENS
MICRO_BATCHES = (slice(0, 3), slice(3, 5))
EXACT = 1e-9  # relative error on the clipped sum and on each norm
# transformers' RMSNorm classes compute in float32 even in a float64 model; their rule computes
# the formula in float64, so sum and norms agree to float32 rounding (tests/test_rms_norm_families).
FLOAT32_INSIDE = 1e-6

# The tiny shapes every transformer shares.
HIDDEN = {"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32}
BERT_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


class Zoo(NamedTuple):
    build: Callable[[], nn.Module]
    inputs: Callable[[], Tensor]  # [BATCH, ...]
    losses: Callable[[nn.Module, Tensor, Tensor], Tensor]  # (model, inputs, labels) -> [B]
    dropout: str  # the config fields set to 0
    tolerance: float = EXACT
    micro_batches: tuple[slice, ...] = MICRO_BATCHES


class Outcome(NamedTuple):
    outcome: str  # exact | exact to float32 | refused | crashed | WRONG
    detail: str  # the relative error, or the refusal's (or crash's) first line
    per_example_path: list[str]
    seconds: float


def classification_losses(model, inputs, labels):
    return F.cross_entropy(model(inputs), labels, reduction="none")


def causal_losses(model, tokens, labels):
    return next_token_losses(model(tokens), tokens)


def text() -> Tensor:
    """[B, 2, T]: ids and attention mask, right padded (pad id 1, as RoBERTa's)."""
    ids = torch.randint(2, VOCAB, (BATCH, TOKENS))
    mask = (torch.arange(TOKENS) < torch.tensor(LENGTHS).unsqueeze(1)).long()
    return torch.stack([ids.masked_fill(mask == 0, 1), mask], dim=1)


def images(size: int = 8, channels: int = 3) -> Callable[[], Tensor]:
    return lambda: torch.randn(BATCH, channels, size, size)


def hf(config_class: str, model_class: str, wrap: Callable = lambda m: m, **config):
    """A builder of transformers' `model_class` from `config_class(**config)`, eager attention,
    wrapped (SequenceClassifier, CausalLM, a head of ours) and in float64."""
    def build() -> nn.Module:
        import transformers

        hf_config = getattr(transformers, config_class)(**config)
        hf_config._attn_implementation = "eager"
        model = getattr(transformers, model_class)(hf_config)
        with torch.no_grad():  # norms start at ones: make every example's gradient generic
            for module in model.modules():
                if type(module).__name__.endswith(("RMSNorm", "LayerNorm")) and hasattr(
                        module, "weight") and module.weight is not None:
                    module.weight.normal_(1.0, 0.3)
        return wrap(model).double()
    return build


def encoder(config_class: str, model_class: str, dropout: dict, **config) -> Zoo:
    """A text classifier, through the product's SequenceClassifier (positions per example)."""
    build = hf(config_class, model_class, SequenceClassifier, **{
        "vocab_size": VOCAB, "max_position_embeddings": 16, "num_labels": CLASSES,
        "pad_token_id": 1, **HIDDEN, **dropout, **config})
    return Zoo(build, text, classification_losses, ", ".join(dropout))


def decoder(config_class: str, dropout: dict, tolerance: float = EXACT,
            model_class: str | None = None, **config) -> Zoo:
    """A causal LM with its next-token loss, through the product's CausalLM."""
    model_class = model_class or config_class.replace("Config", "ForCausalLM")
    build = hf(config_class, model_class, CausalLM, vocab_size=VOCAB, pad_token_id=1,
               **{**HIDDEN, **dropout, **config})
    return Zoo(build, text, causal_losses, ", ".join(dropout), tolerance)


def vision(config_class: str, model_class: str, dropout: dict, size: int = 8,
           **config) -> Zoo:
    build = hf(config_class, model_class, image_size=size, num_channels=3,
               num_labels=CLASSES, **{**dropout, **config})
    return Zoo(build, images(size), lambda m, x, y: classification_losses(
        lambda x: m(pixel_values=x).logits, x, y), ", ".join(dropout))


def fixed(entry: Zoo) -> Zoo:
    """The entry with `raydp_train.fix` applied: BatchNorm replaced by GroupNorm."""
    from raydp_train.privacy.fixes import fix

    def build() -> nn.Module:
        model = entry.build()
        fix(model)
        return model

    return entry._replace(build=build)


class PooledHead(nn.Module):
    """A Linear head on a transformers backbone's mean-pooled last hidden state."""

    def __init__(self, backbone: nn.Module, width: int, text: bool = True):
        super().__init__()
        self.backbone, self.head, self.text = backbone, nn.Linear(width, CLASSES), text

    def forward(self, inputs: Tensor) -> Tensor:
        if not self.text:
            return self.head(self.backbone(pixel_values=inputs).last_hidden_state.mean(1))
        ids, mask = inputs[:, 0], inputs[:, 1]
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if "position_ids" in inspect.signature(self.backbone.forward).parameters:
            kwargs["position_ids"] = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
        hidden = self.backbone(**kwargs).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1))


class RecurrentClassifier(nn.Module):
    """An embedding, a torch sequence layer (LSTM, GRU, TransformerEncoder) and a head on the
    last real token."""

    def __init__(self, kind: str):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        if kind == "transformer":
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.sequence = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        else:
            self.sequence = getattr(nn, kind)(8, 8, num_layers=2 if kind == "LSTM" else 1,
                                              batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        ids, mask = tokens[:, 0], tokens[:, 1]
        hidden = self.sequence(self.embedding(ids))
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        last = mask.sum(1) - 1
        return self.head(hidden[torch.arange(ids.shape[0]), last])


def torch_sequence(kind: str) -> Zoo:
    return Zoo(lambda: RecurrentClassifier(kind).double(), text, classification_losses,
               "dropout" if kind == "transformer" else "")


ROPE = {"max_position_embeddings": 16, "num_hidden_layers": 1}
LLAMA_DROPOUT = {"attention_dropout": 0.0}
LLAMA_LIKE = {"num_key_value_heads": 1, **ROPE}
ZOO: dict[str, Zoo] = {
    # Text encoders: transformers' sequence classifiers.
    "BERT": encoder("BertConfig", "BertForSequenceClassification", BERT_DROPOUT,
                    num_hidden_layers=1),
    "RoBERTa": encoder("RobertaConfig", "RobertaForSequenceClassification", BERT_DROPOUT,
                       num_hidden_layers=1, max_position_embeddings=20),
    "ALBERT": encoder("AlbertConfig", "AlbertForSequenceClassification",
                      {**BERT_DROPOUT, "classifier_dropout_prob": 0.0}, num_hidden_layers=1,
                      embedding_size=8),
    "ELECTRA": encoder("ElectraConfig", "ElectraForSequenceClassification", BERT_DROPOUT,
                       num_hidden_layers=1, embedding_size=8),
    "DistilBERT": encoder("DistilBertConfig", "DistilBertForSequenceClassification",
                          {"dropout": 0.0, "attention_dropout": 0.0,
                           "seq_classif_dropout": 0.0},
                          n_layers=1, dim=16, n_heads=2, hidden_dim=32),
    "DeBERTa-v2": encoder("DebertaV2Config", "DebertaV2ForSequenceClassification",
                          {**BERT_DROPOUT, "pooler_dropout": 0.0}, num_hidden_layers=1,
                          relative_attention=True, position_buckets=4, max_relative_positions=8,
                          pos_att_type=["p2c", "c2p"]),
    "MPNet": encoder("MPNetConfig", "MPNetForSequenceClassification", BERT_DROPOUT,
                     num_hidden_layers=1, max_position_embeddings=20),
    "MPNet, one micro-batch of T examples": encoder(
        "MPNetConfig", "MPNetForSequenceClassification", BERT_DROPOUT, num_hidden_layers=1,
        max_position_embeddings=20)._replace(micro_batches=(slice(0, TOKENS),)),
    "MobileBERT": encoder("MobileBertConfig", "MobileBertForSequenceClassification",
                          {**BERT_DROPOUT, "classifier_dropout": 0.0}, num_hidden_layers=1,
                          embedding_size=8, intra_bottleneck_size=8, true_hidden_size=8,
                          num_feedforward_networks=1),
    # Decoders: causal LMs with their next-token loss.
    "GPT-2": decoder("GPT2Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
                     model_class="GPT2LMHeadModel", n_layer=1, n_embd=16, n_head=2, n_positions=16),
    "GPT-Neo": decoder("GPTNeoConfig", {"resid_dropout": 0.0, "embed_dropout": 0.0,
                                        "attention_dropout": 0.0},
                       num_layers=1, attention_types=[[["global"], 1]], max_position_embeddings=16,
                       window_size=4),
    "GPT-NeoX": decoder("GPTNeoXConfig", {"attention_dropout": 0.0, "hidden_dropout": 0.0},
                        **ROPE, rotary_pct=0.5),
    "GPT-J": decoder("GPTJConfig", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
                     n_layer=1, n_embd=16, n_head=2, n_positions=16, rotary_dim=4),
    "OPT": decoder("OPTConfig", {"dropout": 0.0, "attention_dropout": 0.0,
                                 "layerdrop": 0.0},
                   num_hidden_layers=1, ffn_dim=32, word_embed_proj_dim=16,
                   max_position_embeddings=16),
    "BLOOM": decoder("BloomConfig", {"hidden_dropout": 0.0, "attention_dropout": 0.0},
                     n_layer=1, n_head=2),
    "Falcon": decoder("FalconConfig", {"hidden_dropout": 0.0, "attention_dropout": 0.0},
                      **ROPE, num_kv_heads=1, new_decoder_architecture=False,
                      multi_query=True),
    "Llama": decoder("LlamaConfig", LLAMA_DROPOUT, FLOAT32_INSIDE, **LLAMA_LIKE),
    "Mistral": decoder("MistralConfig", LLAMA_DROPOUT, FLOAT32_INSIDE, sliding_window=4,
                       **LLAMA_LIKE),
    "Qwen2": decoder("Qwen2Config", LLAMA_DROPOUT, FLOAT32_INSIDE, tie_word_embeddings=True,
                     **LLAMA_LIKE),
    "Gemma": decoder("GemmaConfig", LLAMA_DROPOUT, FLOAT32_INSIDE, head_dim=8, **LLAMA_LIKE),
    "Qwen3": decoder("Qwen3Config", LLAMA_DROPOUT, FLOAT32_INSIDE, head_dim=8, **LLAMA_LIKE),
    "Phi-3": decoder("Phi3Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                    "attention_dropout": 0.0}, FLOAT32_INSIDE, **ROPE,
                     num_key_value_heads=1),
    "OLMo": decoder("OlmoConfig", {"attention_dropout": 0.0}, **ROPE, num_key_value_heads=1),
    "StableLM": decoder("StableLmConfig", {"attention_dropout": 0.0, "hidden_dropout": 0.0},
                        **ROPE, num_key_value_heads=1),
    "GPT-BigCode (StarCoder)": decoder(
        "GPTBigCodeConfig", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        n_layer=1, n_embd=16, n_head=2, n_positions=16, multi_query=True),
    "Phi": decoder("PhiConfig", {"resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                 "attention_dropout": 0.0}, **ROPE, partial_rotary_factor=0.5),
    # Encoders of encoder-decoder models, and CLIP's towers.
    "T5 encoder": Zoo(hf("T5Config", "T5EncoderModel", lambda m: PooledHead(m, 16),
                         vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                         num_heads=2, relative_attention_num_buckets=4, dropout_rate=0.0),
                      text, classification_losses, "dropout_rate", FLOAT32_INSIDE),
    # T5's (and MPNet's) relative attention bias looks its Embedding up with [T, T] bucket
    # ids, no example dimension: a call shared by the examples. A micro-batch of T examples
    # checks that the table's T rows are never taken for T examples.
    "T5 encoder, one micro-batch of T examples": Zoo(
        hf("T5Config", "T5EncoderModel", lambda m: PooledHead(m, 16), vocab_size=VOCAB,
           d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
           relative_attention_num_buckets=4, dropout_rate=0.0),
        text, classification_losses, "dropout_rate", FLOAT32_INSIDE, (slice(0, TOKENS),)),
    "Whisper encoder": Zoo(
        hf("WhisperConfig", "WhisperForAudioClassification", num_mel_bins=4, d_model=16,
           encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
           decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32,
           max_source_positions=4, classifier_proj_size=8, num_labels=CLASSES, dropout=0.0,
           attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0),
        lambda: torch.randn(BATCH, 4, 8),
        lambda m, x, y: classification_losses(lambda x: m(input_features=x).logits, x, y),
        "dropout, attention_dropout, activation_dropout, encoder_layerdrop"),
    "CLIP text": Zoo(hf("CLIPTextConfig", "CLIPTextModel", lambda m: PooledHead(m, 16),
                        vocab_size=VOCAB, max_position_embeddings=16, num_hidden_layers=1,
                        attention_dropout=0.0, **HIDDEN),
                     text, classification_losses, "attention_dropout"),
    # Vision.
    "ViT": vision("ViTConfig", "ViTForImageClassification", BERT_DROPOUT, patch_size=4,
                  num_hidden_layers=1, **HIDDEN),
    "DeiT": vision("DeiTConfig", "DeiTForImageClassification", BERT_DROPOUT, patch_size=4,
                   num_hidden_layers=1, **HIDDEN),
    "CLIP vision": Zoo(hf("CLIPVisionConfig", "CLIPVisionModel",
                          lambda m: PooledHead(m, 16, text=False), image_size=8, patch_size=4,
                          num_hidden_layers=1, attention_dropout=0.0, **HIDDEN),
                       images(8), classification_losses, "attention_dropout"),
    "SigLIP vision": Zoo(hf("SiglipVisionConfig", "SiglipVisionModel",
                            lambda m: PooledHead(m, 16, text=False), image_size=8, patch_size=4,
                            num_hidden_layers=1, attention_dropout=0.0, **HIDDEN),
                         images(8), classification_losses, "attention_dropout"),
    "DINOv2": vision("Dinov2Config", "Dinov2ForImageClassification",
                     {**BERT_DROPOUT, "drop_path_rate": 0.0}, patch_size=4,
                     num_hidden_layers=1, hidden_size=16, num_attention_heads=2, mlp_ratio=2),
    "BEiT": vision("BeitConfig", "BeitForImageClassification",
                   {**BERT_DROPOUT, "drop_path_rate": 0.0}, patch_size=4, num_hidden_layers=1,
                   use_relative_position_bias=True, **HIDDEN),
    "Swin": vision("SwinConfig", "SwinForImageClassification",
                   {**BERT_DROPOUT, "drop_path_rate": 0.0}, patch_size=2, embed_dim=8,
                   depths=[1, 1], num_heads=[1, 2], window_size=2),
    "ConvNeXt": vision("ConvNextConfig", "ConvNextForImageClassification",
                       {"drop_path_rate": 0.0}, patch_size=2, hidden_sizes=[8, 16],
                       depths=[1, 1], num_stages=2),
    "ResNet (BatchNorm)": vision("ResNetConfig", "ResNetForImageClassification", {},
                                 embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]),
    "ResNet, model.fix": fixed(vision("ResNetConfig", "ResNetForImageClassification", {},
                                      embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])),
    # Mobile and designed-space convolutional networks (depthwise and grouped convolutions),
    # with BatchNorm replaced by GroupNorm as for ResNet; MobileViT mixes them with attention.
    "MobileNetV2, model.fix": fixed(vision(
        "MobileNetV2Config", "MobileNetV2ForImageClassification",
        {"classifier_dropout_prob": 0.0}, depth_multiplier=0.25, min_depth=4)),
    "RegNet, model.fix": fixed(vision("RegNetConfig", "RegNetForImageClassification", {},
                                      size=16, embedding_size=8, hidden_sizes=[8, 16],
                                      depths=[1, 1], groups_width=4)),
    "MobileViT, model.fix": fixed(vision(
        "MobileViTConfig", "MobileViTForImageClassification",
        {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
         "classifier_dropout_prob": 0.0}, size=16, hidden_sizes=[8, 8, 8],
        neck_hidden_sizes=[4, 4, 8, 8, 8, 8, 16], num_attention_heads=2)),
    # torch's own layers.
    "nn.TransformerEncoder": torch_sequence("transformer"),
    "LSTM classifier": torch_sequence("LSTM"),
    "GRU classifier": torch_sequence("GRU"),
}

# Where the engine falls short of "exact or refused by name" (reproductions in the tests).
KNOWN_BUGS: dict[str, str] = {}


def check(name: str) -> Outcome:
    """The engine over the entry's micro-batches against the naive loop, every example
    clipped. A refusal (the engine's errors for people) is an outcome; any other exception
    is a crash."""
    entry = ZOO[name]
    torch.manual_seed(0)
    start = time.perf_counter()
    model = entry.build().train()
    inputs, labels = entry.inputs(), torch.arange(BATCH) % CLASSES
    try:
        PerExampleClipper(model, 1.0).close()  # refusals at construction come first
        expected_rows = per_example_grads(model, entry.losses, inputs, labels)
        every = 0.5 * expected_rows.norm(dim=1).min().item()
        expected, norms, _ = clip_and_sum(expected_rows, every)
        clipper = PerExampleClipper(model, every)
        got_norms = torch.cat([clipper.accumulate(entry.losses, model, inputs[rows],
                                                  labels[rows]).norms
                               for rows in entry.micro_batches])
    except Exception as error:  # noqa: BLE001 -- reported by name, as the engine gave it
        first = str(error).splitlines()[0] if str(error) else "(no message)"
        return Outcome("refused" if isinstance(error, UserError) else "crashed",
                       f"{type(error).__name__}: {first}", [], time.perf_counter() - start)
    got = engine_sum_in_parameter_order(model, clipper)
    path = list(clipper.per_example_path)
    clipper.close()
    error = max((got - expected).abs().max().item() / expected.abs().max().item(),
                ((got_norms - norms).abs() / norms).max().item())
    outcome = ("exact" if error < EXACT else
               "exact to float32" if error < entry.tolerance else "WRONG")
    return Outcome(outcome, f"relative error {error:.1e}", path, time.perf_counter() - start)
