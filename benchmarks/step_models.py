"""The vision and sequence workloads of benchmarks/step_overhead.py: a ViT-tiny (Hugging Face
ViTConfig), an LSTM classifier and a `nn.TransformerEncoder` classifier, each with its batch."""

from __future__ import annotations

import torch
import transformers
from torch import Tensor, nn

VOCAB = 5000


class VitClassifier(nn.Module):
    """ViTForImageClassification returning logits."""

    def __init__(self, config: transformers.ViTConfig):
        super().__init__()
        self.vit = transformers.ViTForImageClassification(config)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.vit(pixel_values=pixels).logits


class LstmClassifier(nn.Module):
    """Token embedding, one LSTM layer, the last hidden state to the classes."""

    def __init__(self, embedding: int = 64, hidden: int = 128, classes: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, embedding)
        self.sequence = nn.LSTM(embedding, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: Tensor) -> Tensor:
        hidden, _ = self.sequence(self.embedding(ids))
        return self.head(hidden[:, -1])


class EncoderClassifier(nn.Module):
    """Token and position embeddings, a `nn.TransformerEncoder` (torch's attention), mean
    pooling, a Linear head. Positions are looked up per example ([B, T])."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, tokens: int = 64,
                 classes: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(tokens, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        hidden = self.encoder(self.embedding(ids) + self.positions(positions.contiguous()))
        return self.head(hidden.mean(1))


def vision_and_sequence_workloads(workload, steps: int | None) -> list:
    """`workload(name, description, model, features, labels, steps)` for each."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=192,
                                    num_hidden_layers=4, num_attention_heads=3,
                                    intermediate_size=768, num_labels=10,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                    attn_implementation="sdpa")
    return [
        workload("vit", "ViT-tiny (HF ViTConfig: hidden 192, 4 layers, 3 heads, MLP 768, "
                 "patch 4 on 3x32x32, 65 tokens, 10 classes), B=32", VitClassifier(config),
                 torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)), steps or 20),
        workload("lstm", f"LSTM classifier (Embedding {VOCAB}x64, LSTM 64->128, Linear), "
                 "B=32, T=32", LstmClassifier(), torch.randint(0, VOCAB, (32, 32)),
                 torch.randint(0, 2, (32,)), steps or 20),
        workload("transformer", "nn.TransformerEncoder classifier (Embedding "
                 f"{VOCAB}x128 + positions, 2 layers, 4 heads, FFN 512, batch_first, dropout 0, "
                 "mean pool, Linear), B=32, T=64", EncoderClassifier(),
                 torch.randint(0, VOCAB, (32, 64)), torch.randint(0, 2, (32,)), steps or 20),
    ]
