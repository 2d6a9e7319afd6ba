"""DP-LoRA (ARCHITECTURE.md §2.9): adapters folded into their layer's matmul, clipped by the
engine exactly as a naive per-example loop clips them (float64, padding included), base
weights frozen, DP-SGD's accounting, and a released model that is the merged architecture
plus the adapters alone, which peft loads."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from oracles import engine_sum_in_parameter_order, naive_clipped_sum

from raydp_train.config.pipeline import LoraConfig, PipelineError, load_pipeline, pipeline_from_dict
from raydp_train.models.builders import build_model
from raydp_train.privacy.lora import LoraSetupError
from raydp_train.privacy.mechanism import LowRankAdapters, mechanism_named
from raydp_train.reports.run import privacy_statement, write_run_record
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")
pytest.importorskip("peft", reason="peft is a runtime dependency (DP-LoRA)")

BATCH = 5
TINY_BERT = {"model_type": "bert", "vocab_size": 40, "num_hidden_layers": 2,
             "max_position_embeddings": 16, "hidden_size": 16, "num_attention_heads": 2,
             "intermediate_size": 32, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0}


def attached(model, clip_norm: float, **settings):
    """LoRA attached as a worker attaches it: (mechanism, its clipper)."""
    mechanism = LowRankAdapters(SimpleNamespace(lora=LoraConfig(**settings)),
                                torch.Generator().manual_seed(0))
    return mechanism, mechanism.attach(model, clip_norm)


def tiny_bert():
    from raydp_train.config.pipeline import HFModel
    from raydp_train.models.hf import build_hf_model

    torch.manual_seed(0)
    return build_hf_model(HFModel(kind="hf", config=TINY_BERT, num_labels=2), num_labels=2)


def padded_tokens(lengths: tuple, tokens: int) -> torch.Tensor:
    ids = torch.randint(2, 40, (len(lengths), tokens))
    mask = torch.zeros(len(lengths), tokens, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return torch.stack([ids.masked_fill(mask == 0, 0), mask], dim=1)


def example_losses(model, tokens, labels):
    return F.cross_entropy(model(tokens), labels, reduction="none")


@pytest.mark.parametrize("lengths, tokens", [((7, 5, 3, 7, 4), 7), ((6, 5, 3, 2, 4), 9)],
                         ids=["dense", "padded"])
def test_adapter_clipped_sums_equal_a_naive_loop(lengths, tokens):
    torch.set_default_dtype(torch.float64)
    try:
        model = tiny_bert()
        _, clipper = attached(model, 1.0, rank=4, layers=["*attention.self.query",
                                                          "*attention.self.value"])
        # B starts at 0 (the model is unchanged); give it values so A's gradient is not 0.
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.5)
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        assert sum(".lora_" in n for n in trained) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
        assert not [n for n in trained if "base_layer" in n]  # adapted weights are frozen
        inputs, labels = padded_tokens(lengths, tokens), torch.randint(0, 2, (BATCH,))
        expected, norms, clip_norm = naive_clipped_sum(model, example_losses, inputs, labels)
        clipper.clip_norm = clip_norm  # the median: some examples clip, some do not
        stats = clipper.accumulate(example_losses, model, inputs, labels)
        got = engine_sum_in_parameter_order(model, clipper)
        torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=1e-12)
        assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-6
        clipper.close()
    finally:
        torch.set_default_dtype(torch.float32)


class SharedLayer(torch.nn.Module):
    """One Linear applied twice (to two halves of each example), then a head: an adapted
    layer called more than once per forward."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = torch.nn.Linear(6, 5), torch.nn.Linear(10, 3)

    def forward(self, x):
        first, second = x.chunk(2, dim=1)
        return self.head(torch.cat([self.shared(first).tanh(), self.shared(second)], 1))


def test_an_adapter_called_twice_sums_both_calls_as_a_naive_loop(float64):
    torch.manual_seed(0)
    model = SharedLayer()
    _, clipper = attached(model, 1.0, rank=2, alpha=3.0, layers=["shared"])
    torch.nn.init.normal_(model.shared.lora_B, std=0.5)  # else A's gradient is 0
    inputs, labels = torch.randn(BATCH, 12), torch.randint(0, 3, (BATCH,))
    expected, norms, clip_norm = naive_clipped_sum(model, example_losses, inputs, labels)
    clipper.clip_norm = clip_norm
    stats = clipper.accumulate(example_losses, model, inputs, labels)
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=1e-12)
    got = engine_sum_in_parameter_order(model, clipper)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-9
    clipper.close()


def digits(**lora):
    return pipeline_from_dict({
        "name": "digits", "data": {"source": "sklearn_digits"},
        "model": {"kind": "mlp", "hidden_sizes": [64]},
        "privacy": {"mechanism": "lora", "noise_multiplier": 1.0, "clip_norm": 1.0,
                    "lora": {"rank": 4, "alpha": 8, **lora}},
        "training": {"epochs": 3, "batch_size": 128, "lr": 0.5}, "run": {"seed": 0}})


def test_lora_trains_only_adapters_and_releases_the_merged_model(tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel

    pipeline = digits(layers=["1"])  # the hidden layer; the head trains with DP-SGD
    plan = make_plan(pipeline, 1438)
    torch.manual_seed(0)
    initial = build_model(pipeline.model, (64,), 10)
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None))
    names = [n for n, p in result.model.named_parameters() if p.requires_grad]
    assert names == ["1.lora_A", "1.lora_B", "3.weight", "3.bias"]
    assert result.trained_per_step == 4 * 64 + 64 * 4 + 64 * 10 + 10
    base = result.model[1].base_layer
    assert torch.equal(base.weight, initial[1].weight) and torch.equal(base.bias, initial[1].bias)
    assert result.metrics[-1]["test_accuracy"] > 0.3
    # Accounted as DP-SGD: the same epsilon for the same q, sigma and steps.
    dpsgd = make_plan(pipeline.model_copy(update={"privacy": pipeline.privacy.model_copy(
        update={"mechanism": "dpsgd", "lora": None})}), 1438)
    assert result.metrics[-1]["epsilon"] == pytest.approx(dpsgd.epsilon())

    write_run_record(tmp_path, pipeline, result, privacy_statement(plan, result, 1))
    x = torch.randn(6, 64)
    result.model.eval()
    # model.pt: the merged adapters in the architecture the pipeline builds.
    plain = build_model(pipeline.model, (64,), 10)
    plain.load_state_dict(torch.load(tmp_path / "model.pt"))
    torch.testing.assert_close(plain.eval()(x), result.model(x), rtol=1e-5, atol=1e-5)
    # adapter/: peft's own loader on the initial weights is the trained model: the trained
    # head (module 3, DP-SGD) comes in the adapter's modules_to_save.
    loaded = PeftModel.from_pretrained(initial, tmp_path / "adapter")
    assert PeftLoraConfig.from_pretrained(tmp_path / "adapter").modules_to_save == ["3"]
    torch.testing.assert_close(loaded.eval()(x), result.model(x), rtol=1e-5, atol=1e-5)


def test_a_merged_hf_model_reloads_with_from_pretrained_and_predicts_the_same(tmp_path):
    from raydp_train.reports.run import save_hf_model

    model = tiny_bert()
    mechanism, clipper = attached(model, 1.0, rank=4)
    clipper.close()
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # as if trained: a nonzero update
            torch.nn.init.normal_(parameter, std=0.5)
    released = mechanism.released(model)
    assert not [n for n, _ in released.named_parameters() if "lora" in n or "base_layer" in n]
    save_hf_model(released, SimpleNamespace(name_or_path=None), tmp_path / "model")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "model")
    tokens = padded_tokens((5, 3), 6)
    with torch.no_grad():
        expected = model.eval()(tokens)
        got = reloaded.eval()(input_ids=tokens[:, 0], attention_mask=tokens[:, 1]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bad_lora_settings_name_their_field():
    model = build_model(digits().model, (64,), 10)
    with pytest.raises(LoraSetupError, match=r"privacy.lora.layers: patterns \['nope\*'\]"):
        attached(model, 1.0, layers=["nope*"])
    with pytest.raises(LoraSetupError, match="privacy.lora.rank: no trainable Linear"):
        attached(build_model(digits().model, (64,), 10), 1.0, rank=64)
    with pytest.raises(PipelineError, match="privacy.lora: only allowed with mechanism: lora"):
        pipeline_from_dict({**digits().model_dump(), "privacy": {
            "noise_multiplier": 1.0, "lora": {"rank": 2}}})
    with pytest.raises(PipelineError, match="privacy.lora.dropout: only 0, got 0.1: each adapter "
                                            "is folded into its layer's one matmul"):
        digits(dropout=0.1)


def test_budgets_and_sweeps_take_lora():
    spend = make_plan(digits(), 1438).spend(10, 0)
    assert spend.mechanism == "lora" and mechanism_named("lora").private
    spend.check()
    space = ("tune.search_space={privacy.lora.rank: {choice: [2, 4]}, "
             "privacy.lora.alpha: {loguniform: [4, 32]}}")
    sweep = load_pipeline("pipelines/sweep_digits.yaml", ["privacy.mechanism=lora", space])
    assert set(sweep.tune.search_space) == {"privacy.lora.rank", "privacy.lora.alpha"}
    with pytest.raises(PipelineError, match="searching privacy.lora fields needs"):
        load_pipeline("pipelines/sweep_digits.yaml", [space])
