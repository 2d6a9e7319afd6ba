"""A Vision Transformer of your own for `model.kind: torch` (pipelines/digits_vit.yaml), written
with torch's own layers, or built from a Hugging Face `ViTConfig`. No layer needs changing for
DP-SGD: the Conv2d patch embedding, the Linear layers and the LayerNorms take the engine's rules,
and the cls token and position embeddings (raw parameters the model adds itself) and
nn.MultiheadAttention take the per-example path (privacy.other_layers: per_example). Dropout
stays 0: a module on the per-example path may not draw random numbers."""

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int, mlp_width: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_width), nn.GELU(),
                                 nn.Linear(mlp_width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """[B, C, H, W] images -> [B, num_classes] logits: patches, a cls token, position
    embeddings, `depth` blocks, the cls token's final state into a Linear head."""

    def __init__(self, feature_shape: tuple[int, ...], num_classes: int, patch_size: int,
                 width: int, depth: int, heads: int, mlp_width: int):
        super().__init__()
        channels, height, image_width = feature_shape
        patches = (height // patch_size) * (image_width // patch_size)
        self.patches = nn.Conv2d(channels, width, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(0.02 * torch.randn(1, patches + 1, width))
        self.blocks = nn.Sequential(*(Block(width, heads, mlp_width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(images).flatten(2).transpose(1, 2)  # [B, patches, width]
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        tokens = torch.cat([cls, tokens], dim=1) + self.position
        return self.head(self.norm(self.blocks(tokens))[:, 0])


def vit(feature_shape: tuple[int, ...], num_classes: int, patch_size: int = 2, width: int = 32,
        depth: int = 2, heads: int = 4, mlp_width: int = 64) -> nn.Module:
    """`model.factory: models/vit.py:vit`: the ViT above (torch's nn.MultiheadAttention)."""
    return ViT(feature_shape, num_classes, patch_size, width, depth, heads, mlp_width)


class Logits(nn.Module):
    """A Hugging Face image classifier's output -> its logits tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).logits


def hf_vit(feature_shape: tuple[int, ...], num_classes: int, patch_size: int = 2,
           width: int = 32, depth: int = 2, heads: int = 4, mlp_width: int = 64) -> nn.Module:
    """`model.factory: models/vit.py:hf_vit`: transformers' ViTForImageClassification from a
    ViTConfig (random weights, nothing downloaded), the same sizes as `vit`."""
    from transformers import ViTConfig, ViTForImageClassification

    channels, height, _ = feature_shape
    config = ViTConfig(image_size=height, patch_size=patch_size, num_channels=channels,
                       hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
                       intermediate_size=mlp_width, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=num_classes)
    return Logits(ViTForImageClassification(config))
