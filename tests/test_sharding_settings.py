"""`training.sharding: fsdp`: what it cannot serve is refused by the schema, by name, before
anything runs or any budget is reserved; and which rules run on sharded weights."""

import pytest
import torch
from torch import nn

from raydp_train.config.errors import PipelineError
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.sharding import dim0_rows, shard_seed, shardable_rule, sharded_blocks


def raw(**training) -> dict:
    return {"name": "t", "data": {"source": "synthetic"}, "model": {"kind": "logistic"},
            "privacy": {"noise_multiplier": 1.0},
            "training": {"workers": 2, "sharding": "fsdp", **training}}


def test_none_is_the_default_and_fsdp_over_two_workers_is_accepted():
    assert pipeline_from_dict({**raw(), "training": {}}).training.sharding == "none"
    assert pipeline_from_dict(raw()).training.sharding == "fsdp"


@pytest.mark.parametrize("change, field, words", [
    ({"training": {"workers": 1, "sharding": "fsdp"}}, "training.sharding", "workers >= 2"),
    ({"privacy": {"mechanism": "lsg", "noise_multiplier": 1.0}}, "training.sharding",
     "carriers from whole weights"),
    ({"privacy": {"mechanism": "none"}}, "training.sharding", "non-private"),
    ({"training": {"workers": 2, "sharding": "fsdp", "cache_frozen_prefix": True}},
     "training.cache_frozen_prefix", "outside FSDP"),
    ({"privacy": {"noise_multiplier": 1.0, "clipping": "adaptive"}}, "privacy.clipping",
     "not checked sharded"),
])
def test_what_cannot_shard_is_refused_by_name(change, field, words):
    with pytest.raises(PipelineError) as refused:
        pipeline_from_dict({**raw(), **change})
    assert field in str(refused.value) and words in str(refused.value)


def test_the_frozen_base_in_bf16_is_refused_under_sharding():
    hf = {"kind": "hf", "name_or_path": "prajjwal1/bert-tiny", "num_labels": 2,
          "frozen_dtype": "bf16"}
    with pytest.raises(PipelineError, match="model.frozen_dtype.*FSDP gathers one dtype"):
        pipeline_from_dict({**raw(), "model": hf,
                            "privacy": {"mechanism": "lora", "noise_multiplier": 1.0}})


def test_each_rank_has_its_own_noise_seed_and_fsdp_rows_cover_each_row_once():
    assert len({shard_seed(7, rank) for rank in range(8)} | {shard_seed(8, 0)}) == 9
    for rows in (0, 1, 3, 4, 7):
        ranges = dim0_rows(rows, 3)
        assert [r for a, b in ranges for r in range(a, b)] == list(range(rows))
        chunks = [len(chunk) for chunk in torch.arange(rows).chunk(3)]  # FSDP2's shards
        assert [b - a for a, b in ranges] == chunks + [0] * (3 - len(chunks))


def test_blocks_are_the_largest_layer_list_else_the_top_level_children():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layers = nn.Embedding(5, 4), nn.ModuleList(nn.Linear(4, 4)
                                                                         for _ in range(3))
    stack = Stack()
    assert sharded_blocks(stack) == list(stack.layers)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert sharded_blocks(mlp) == [mlp[0], mlp[2]]


def test_rules_that_read_weights_after_the_backward_are_not_shardable():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(3, 4),
                          nn.MultiheadAttention(4, 2, batch_first=True))
    clipper = PerExampleClipper(model, 1.0)
    shardable = {type(module).__name__: shardable_rule(rule) for _, module, rule in clipper.layers}
    clipper.close()
    assert shardable == {"Linear": True, "LayerNorm": True, "Embedding": True,
                         "MultiheadAttention": False}
