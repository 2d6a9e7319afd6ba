"""`raydp-train validate` tells the truth about the budget: it reads the ledger (no Ray),
prints the epsilon left and, for a sweep, the whole search's epsilon, and exits 3 when the
budget cannot pay."""

import sys

import dp_accounting
import pytest
from dp_accounting import rdp
from text_files import MINILM, text_pipeline

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.ledger import as_uri
from raydp_train.budget.terms import BudgetTerms, Spend
from raydp_train.commands.cli import EXIT_BUDGET_EXHAUSTED, main

SWEEP = "pipelines/sweep_digits.yaml"
# sweep_digits: N = 1150, batch 128 -> q = 0.111304, 71 steps and 8 validation releases (sigma
# 4) per trial; trials search sigma in {1.2, 1.5, 2.0}.
Q, STEPS, RELEASES = 128 / 1150, 71, 8


def sets(tmp_path, *more: str, epsilon: float = 10.0) -> list[str]:
    overrides = [f"budget.ledger={tmp_path}/budgets", "budget.name=b", f"budget.epsilon={epsilon}",
                 f"run.output_dir={tmp_path}/runs", *more]
    return [x for o in overrides for x in ("--set", o)]


def spend_earlier(tmp_path, epsilon: float, spend: Spend) -> None:
    """An earlier run's reservation, written to the ledger by an accountant (no Ray)."""
    book = BudgetAccountant(as_uri(f"{tmp_path}/budgets"), BudgetTerms("b", epsilon, 1e-5))
    assert book.reserve("earlier", "earlier-run", spend).granted


def line(out: str, start: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(start))


def trials_epsilon(trials: int, sigma: float) -> float:
    """dp-accounting itself: `trials` trials at `sigma`, steps and releases composed."""
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma)),
        STEPS * trials))
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(4.0), RELEASES * trials))
    return accountant.get_epsilon(1e-5)


def test_a_sweep_prints_the_whole_search_and_how_much_of_it_the_budget_pays(tmp_path, capsys):
    assert main(["validate", SWEEP, *sets(tmp_path)]) == 0
    out = capsys.readouterr().out
    searched = float(line(out, "the sweep will spend").split()[5])
    assert searched == pytest.approx(trials_epsilon(6, 1.2), abs=5e-5)  # 6 trials, sigma 1.2
    assert "composition of 6 trials" in out
    assert "budget left             epsilon 10.0000 of 10" in out
    paid = next(k for k in range(7) if trials_epsilon(k + 1, 1.2) > 10)
    assert f"pays for {paid} of the 6 trials" in out
    assert not (tmp_path / "budgets").exists() and not (tmp_path / "runs").exists()


def test_a_grid_multiplies_the_trials(tmp_path, capsys):
    space = "tune.search_space={privacy.noise_multiplier: {grid: [1.5, 2.0]}}"
    assert main(["validate", SWEEP, *sets(tmp_path, space, "tune.num_samples=2",
                                          epsilon=100)]) == 0
    out = capsys.readouterr().out
    assert "composition of 4 trials" in out
    assert float(line(out, "the sweep will spend").split()[5]) == pytest.approx(
        trials_epsilon(4, 1.5), abs=5e-5)
    assert line(out, "budget after").split()[3] == line(out, "the sweep will spend").split()[5]


def test_a_random_stopping_sweep_is_one_reservation_paid_in_full_or_refused(tmp_path, capsys):
    random_stopping = ("tune.selection=random_stopping", "tune.random_stopping={mean_trials: 3}")
    assert main(["validate", SWEEP, *sets(tmp_path, *random_stopping, epsilon=12)]) == 0
    out = capsys.readouterr().out
    searched = float(line(out, "the sweep will spend").split()[5])
    assert 5 < searched < 12 and "random stopping, mean 3 trials" in out
    assert line(out, "budget after").split()[3] == f"{searched:.4f}"
    assert main(["validate", SWEEP, *sets(tmp_path, *random_stopping, epsilon=8)]) == 3
    assert f"the sweep would bring the budget to epsilon {searched:.4f} of 8" in line(
        capsys.readouterr().out, "CANNOT BE PAID")


def test_a_spent_budget_refuses_the_sweep_and_the_run(tmp_path, capsys):
    spend_earlier(tmp_path, 10.0, Spend(Q, 1.0, 120))
    assert main(["validate", SWEEP, *sets(tmp_path)]) == EXIT_BUDGET_EXHAUSTED
    out = capsys.readouterr().out
    left = float(line(out, "budget left").split()[3])
    assert 0 < left < 5, out  # spent, and shown from the ledger
    assert "CANNOT BE PAID          one trial would bring the budget to" in out
    assert main(["validate", SWEEP, *sets(tmp_path, "tune=null")]) == EXIT_BUDGET_EXHAUSTED
    assert "CANNOT BE PAID          this run would" in capsys.readouterr().out


def test_a_run_that_fits_prints_what_is_left_after_it(tmp_path, capsys):
    spend_earlier(tmp_path, 30.0, Spend(Q, 1.0, 50))
    assert main(["validate", SWEEP, *sets(tmp_path, "tune=null", epsilon=30)]) == 0
    out = capsys.readouterr().out
    left = float(line(out, "budget left").split()[3])
    after = float(line(out, "budget after").split()[3])
    assert 0 < 30 - left < after < 30


def test_other_terms_than_the_ledger_s_are_refused(tmp_path, capsys):
    spend_earlier(tmp_path, 30.0, Spend(Q, 1.0, 50))
    assert main(["validate", SWEEP, *sets(tmp_path, "tune=null", epsilon=20)]) == 2
    assert "budget.epsilon: budget 'b' was created with epsilon=30" in capsys.readouterr().err


def test_an_unreadable_ledger_is_one_line(tmp_path, capsys):
    (tmp_path / "budgets").mkdir()
    (tmp_path / "budgets" / "b").write_text("a file where the budget's folder should be")
    assert main(["validate", SWEEP, *sets(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: budget.ledger: cannot read file://{tmp_path}/budgets/b"), err
    assert err.count("\n") == 1


# Run in a fresh process whose Ray and transformers refuse to start or load weights: each
# validate of the JSON list on stdin (its arguments after the pipeline), one after another;
# prints each one's exit code and output as JSON.
TRAPPED_VALIDATE = """
import contextlib, io, json, sys
import ray
import transformers

def refuse(*args, **kwargs):
    raise AssertionError("validate started Ray or loaded model weights")

ray.init = refuse
transformers.PreTrainedModel.from_pretrained = classmethod(refuse)
transformers.AutoModelForSequenceClassification.from_pretrained = classmethod(refuse)
from raydp_train.commands.cli import main
results = []
for arguments in json.load(sys.stdin):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["validate", sys.argv[1], *arguments])
    results.append({"returncode": code, "stdout": stdout.getvalue(),
                    "stderr": stderr.getvalue()})
print(json.dumps(results))
"""


@pytest.mark.slow
def test_validate_checks_a_pretrained_text_pipeline_without_ray_or_weights(tmp_path):
    import json
    import subprocess
    import sys
    from types import SimpleNamespace

    pipeline = text_pipeline(tmp_path, trainable={"last_k_layers": 1})
    elsewhere = tmp_path / "elsewhere"  # the data path resolves against the pipeline's folder
    elsewhere.mkdir()
    calls = [[], ["--set", "model.trainable.last_k_layers=7"], ["--check-model"],
             ["--check-model", "--set", "model.trainable=[nope.*]"],
             ["--check-model", "--set", "model.trainable=[nope.*]",
              "--set", "data.label_column=nope"],
             ["--check-model", "--set", "training.param_groups=[{params: [nothing.*], lr: 0.1}]"]]
    # One process for all of them: a fresh one each would start Python and import Ray and
    # transformers six times over.
    process = subprocess.run([sys.executable, "-c", TRAPPED_VALIDATE, pipeline], cwd=elsewhere,
                             input=json.dumps(calls), capture_output=True, text=True,
                             timeout=600, check=False)
    assert process.returncode == 0, process.stderr[-3000:]
    results = {tuple(arguments): SimpleNamespace(**result) for arguments, result in
               zip(calls, json.loads(process.stdout.strip().splitlines()[-1]), strict=True)}

    def validate(*arguments: str):
        return results[arguments]

    done = validate()
    assert done.returncode == 0, done.stderr
    assert "training examples N     48 (test 12)" in done.stdout
    # Without --check-model the model's files are checked, not its structure, and it says so.
    assert "model structure         files checked" in done.stdout
    refused = validate("--set", "model.trainable.last_k_layers=7")
    assert refused.returncode == 2
    assert "model.trainable.last_k_layers: the model has 6 layers, got 7" in refused.stderr
    # --check-model builds the structure (on the meta device from config.json), and says
    # nothing then.
    done = validate("--check-model")
    assert done.returncode == 0, done.stderr
    assert "model structure" not in done.stdout
    refused = validate("--check-model", "--set", "model.trainable=[nope.*]")
    assert refused.returncode == 2
    assert "model.trainable: patterns ['nope.*'] match no parameter" in refused.stderr
    # Both the data and the model are wrong: the model's check runs in a forked process, but
    # the data's error is the one reported, as in a run.
    refused = validate("--check-model", "--set", "model.trainable=[nope.*]",
                       "--set", "data.label_column=nope")
    assert refused.returncode == 2
    assert "column(s) ['nope'] not in" in refused.stderr and "nope.*" not in refused.stderr
    # Errors found only by building the optimizer come back from the forked process too.
    refused = validate("--check-model",
                       "--set", "training.param_groups=[{params: [nothing.*], lr: 0.1}]")
    assert refused.returncode == 2, refused.stderr
    assert "training.param_groups" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.slow
def test_validate_without_check_model_imports_neither_torch_nor_transformers(tmp_path):
    """What makes it fast (benchmarks/RESULTS.md, validate's time): the whole command, the
    model's file checks included, runs without the two imports that take seconds."""
    import subprocess

    pipeline = text_pipeline(tmp_path, trainable={"last_k_layers": 1})
    done = subprocess.run([sys.executable, "-c", WHOLE_VALIDATE, pipeline], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "exit 0, heavy []"


def test_the_model_files_are_checked_by_name(tmp_path):
    import json
    import shutil

    from raydp_train.config.pipeline import load_pipeline
    from raydp_train.models.hf_files import HFModelError, check_model_files, resolve_name_or_path

    folder = tmp_path / "model"
    shutil.copytree(resolve_name_or_path(MINILM), folder)
    model = load_pipeline(text_pipeline(tmp_path, name_or_path=str(folder)), []).model
    check_model_files(model)  # the copy is whole
    (folder / "model.safetensors").rename(folder / "elsewhere.safetensors")
    with pytest.raises(HFModelError, match=f"{folder} holds no PyTorch weights"):
        check_model_files(model)
    (folder / "elsewhere.safetensors").rename(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k != "model_type"}))
    with pytest.raises(HFModelError, match=f"{folder}/config.json names no model_type"):
        check_model_files(model)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(HFModelError, match=f"cannot read {folder}/config.json"):
        check_model_files(model)


class Unpicklable(Exception):
    def __init__(self, message: str, extra: object) -> None:
        super().__init__(message)
        self.extra = extra

    def __reduce__(self):
        raise TypeError("cannot pickle")


def raise_unpicklable() -> None:
    raise Unpicklable("the model check failed", lambda: None)


def die() -> None:
    import os

    os._exit(7)


@pytest.mark.slow
def test_a_forked_check_reports_its_error_or_its_death():
    from raydp_train.checks.preflight import _forked

    with _forked(sum, [1, 2]) as fine:
        fine.result()
    with _forked(int, "not a number") as failing, pytest.raises(ValueError, match="not a number"):
        failing.result()
    with _forked(raise_unpicklable) as failing, pytest.raises(RuntimeError,
                                                            match="Unpicklable: the model check"):
        failing.result()
    with _forked(die) as dying, pytest.raises(RuntimeError, match="died \\(exit code 7\\)"):
        dying.result()


@pytest.mark.thorough
def test_a_process_running_ray_is_never_forked(tmp_path, monkeypatch):
    """A sweep's driver (Ray's threads running) checks its candidates without forking."""
    import types

    from raydp_train.checks import preflight
    from raydp_train.config.pipeline import load_pipeline

    def refuse(*args):
        raise AssertionError("forked a process that runs Ray")

    monkeypatch.setattr(preflight, "_forked", refuse)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    pipeline = load_pipeline(text_pipeline(tmp_path))
    dataset, plan = preflight.check_pipeline(pipeline, for_training=False)
    assert plan.num_examples == 48 and dataset.num_train == 48


# The whole `validate` command in this process; prints its exit code and which of the slow
# imports it made.
WHOLE_VALIDATE = """
import sys
from raydp_train.commands.cli import main

code = main(["validate", sys.argv[1]])
heavy = sorted({"torch", "transformers", "pandas", "ray"} & set(sys.modules))
print(f"exit {code}, heavy {heavy}")
"""


# validate's own process checks the tokenizer, the data and the plan while the forked child
# checks the model; they run side by side only if this half never waits for torch.
LIGHT_HALF = """
import sys
from raydp_train.checks import preflight
from raydp_train.config.pipeline import load_pipeline

preflight._check_text_model = lambda pipeline: None  # the child's half, not measured here
dataset, plan = preflight.check_pipeline(load_pipeline(sys.argv[1], []), for_training=False)
heavy = sorted({"torch", "transformers", "pandas", "ray"} & set(sys.modules))
print(plan.steps, heavy)
"""


@pytest.mark.slow
def test_validate_checks_data_plan_and_tokenizer_without_torch(tmp_path):
    import subprocess
    import sys

    pipeline = text_pipeline(tmp_path, trainable={"last_k_layers": 1})
    done = subprocess.run([sys.executable, "-c", LIGHT_HALF, pipeline], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    steps, heavy = done.stdout.split(maxsplit=1)
    assert int(steps) > 0 and heavy.strip() == "[]"


def test_a_broken_tokenizer_file_is_refused_by_name(tmp_path):
    import shutil

    from raydp_train.config.pipeline import load_pipeline
    from raydp_train.models.hf_files import HFModelError, check_tokenizer, resolve_name_or_path

    pipeline = load_pipeline(text_pipeline(tmp_path), [])
    folder = tmp_path / "model"
    shutil.copytree(resolve_name_or_path(pipeline.model.name_or_path), folder)
    config = pipeline.model.model_copy(update={"name_or_path": str(folder)})
    check_tokenizer(config)  # the copy reads
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(HFModelError, match=f"cannot read the tokenizer {folder}/tokenizer.json"):
        check_tokenizer(config)


# Checks pipeline argv[1] once per JSON list of --set overrides in argv[2:], each in this one
# process (no Ray here: validate forks its model check only without it); prints, per check,
# the model checks forked so far and the outcome.
CHECKS = """
import json, sys
from raydp_train.checks import preflight
from raydp_train.config.pipeline import load_pipeline

forks, real_fork = [], preflight._forked
preflight._forked = lambda *call: forks.append(call) or real_fork(*call)
for overrides in sys.argv[2:]:
    try:
        preflight.check_pipeline(load_pipeline(sys.argv[1], json.loads(overrides)), False)
        outcome = "passed"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    print(json.dumps([len(forks), outcome]))
"""


@pytest.mark.slow
def test_a_passed_model_check_is_remembered_until_what_it_read_changes(tmp_path, monkeypatch):
    """validate skips a model check that passed for exactly these inputs, in this process or a
    later one (passed_checks); an edit of the pipeline, of the model's config.json, of a
    library or of raydp_train's own code checks again, and a failed check is never
    remembered."""
    import json
    import shutil
    import subprocess

    from raydp_train.checks import passed as passed_checks
    from raydp_train.config.pipeline import load_pipeline
    from raydp_train.models.hf_files import resolve_name_or_path

    folder = tmp_path / "model"
    shutil.copytree(resolve_name_or_path(MINILM), folder)
    path = text_pipeline(tmp_path, name_or_path=str(folder),
                         trainable=["bert.encoder.layer.5.*", "classifier.*"])

    def checks(*overrides: list[str]) -> list[tuple[int, str]]:
        done = subprocess.run([sys.executable, "-c", CHECKS, path,
                               *[json.dumps(o) for o in overrides]],
                              capture_output=True, text=True, timeout=300, check=True)
        return [tuple(json.loads(line)) for line in done.stdout.splitlines()]

    clip, nope = ["privacy.clip_norm=0.5"], ["model.trainable=[nope.*]"]
    outcomes = checks([], [], clip, clip, nope, nope)
    # the second check is remembered; a field the check reads is checked again, then
    # remembered; a failed check is not remembered
    assert [forks for forks, _ in outcomes] == [1, 1, 2, 2, 3, 4]
    assert [o for _, o in outcomes[:4]] == ["passed"] * 4
    assert all(o.startswith("HFModelError: model.trainable") for _, o in outcomes[4:])
    assert checks([]) == [(0, "passed")]  # remembered by a later process too (a new validate)
    # The in-process checks (run's, a sweep driver's) include validate's model check, and
    # remember it too.
    from raydp_train.checks import preflight

    monkeypatch.setattr(preflight, "_ray_running", lambda: True)  # no fork: checked in process
    lower = ["privacy.clip_norm=0.25"]
    preflight.check_pipeline(load_pipeline(path, lower), for_training=False)
    assert checks(lower) == [(0, "passed")]
    # The model's config changes under the same pipeline: 2 layers, so encoder.layer.5 is gone.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    ((forks, outcome),) = checks([])
    assert forks == 1 and "HFModelError" in outcome and "bert.encoder.layer.5" in outcome

    pipeline = load_pipeline(path, [])
    key = passed_checks._key(pipeline)
    monkeypatch.setattr(passed_checks, "_version", lambda name: "another version")
    assert passed_checks._key(pipeline) != key
    monkeypatch.undo()
    source = tmp_path / "source"
    source.mkdir()
    (source / "module.py").write_text("x = 1\n")
    monkeypatch.setattr(passed_checks, "_SOURCE", source)
    key = passed_checks._key(pipeline)
    (source / "module.py").write_text("x = 22\n")
    assert passed_checks._key(pipeline) != key
    hub = pipeline.model_copy(update={"model": pipeline.model.model_copy(
        update={"name_or_path": "sentence-transformers/all-MiniLM-L6-v2"})})
    assert passed_checks._key(hub) is None  # a hub name's files may change unseen
