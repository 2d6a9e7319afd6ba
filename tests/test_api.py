"""The Python API: the Python blocks of README.md and of the API guide
(docs/guides/python-api.md) run as written, their runs spend what dp-accounting says, `raydp-train run` goes through the same function, and `import
raydp_train` imports neither torch nor Ray."""

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest
import ray.train
from doc_blocks import marked_block, output_labels

import raydp_train as rt
from raydp_train.commands.cli import main

ROOT = Path(__file__).parents[1]
GUIDE = "docs/guides/python-api.md"


def _quickstart_epsilon(epochs: int) -> float:
    """quickstart: 800 training rows (80% of 1,000), batch 64 (q 0.08: 12.5 steps an epoch,
    floor(epochs / q) in all), sigma 2, delta 1e-5."""
    steps = epochs * 800 // 64
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        64 / 800, dp_accounting.GaussianDpEvent(2.0)), steps)
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)


def _run_block(page: str, marker: str, folder: Path, monkeypatch) -> tuple[dict, str]:
    shutil.copytree(ROOT / "pipelines", folder / "pipelines")
    monkeypatch.chdir(folder)
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(marked_block(page, marker), page, "exec"), namespace)  # noqa: S102 (ours)
    return namespace, printed.getvalue()


def test_the_readme_python_block_runs_as_written(ray_session, tmp_path, monkeypatch):
    namespace, output = _run_block("README.md", "python api", tmp_path, monkeypatch)
    result, plan = namespace["result"], namespace["plan"]
    assert result.status == "completed" and not namespace["model"].training
    assert result.epsilon == pytest.approx(_quickstart_epsilon(3), rel=1e-9)
    assert result.epsilon == pytest.approx(plan.epsilon(), rel=1e-12)
    assert output.splitlines()[0].split() == [str(plan.steps), str(plan.noise_multiplier),
                                              str(plan.epsilon())]
    assert f"{result.status} {result.epsilon} " in output


@pytest.mark.long  # make test: the README's block above and test_the_cli_spends_what_the_api_does
def test_the_guides_python_block_runs_as_written(ray_session, tmp_path, monkeypatch):
    namespace, output = _run_block(GUIDE, "python api guide", tmp_path, monkeypatch)
    result = namespace["result"]
    assert isinstance(result, rt.RunResult) and result.status == "completed"
    assert result.epsilon == pytest.approx(_quickstart_epsilon(3), rel=1e-9)
    assert result.epsilon == pytest.approx(namespace["plan"].epsilon(), rel=1e-12)
    assert json.loads(result.record.read_text())["privacy"] == result.privacy
    assert len(result.metrics) == 3 and result.model == result.run_dir / "model.pt"
    assert isinstance(result.ray_result, ray.train.Result)  # Ray Train's, with its checkpoint
    assert result.checkpoint is not None and Path(result.checkpoint.path).is_dir()
    assert not namespace["model"].training
    assert "refused: " in output and "missing.parquet" in output  # the typed error, one line
    assert f"run directory: {result.run_dir}" in output  # on_line's default prints
    assert "epoch   1/3" not in output  # on_epoch=None: no epoch rows
    assert [d.name for d in Path("runs").iterdir()] == [result.run_dir.name]  # no dir for x


@pytest.mark.slow
def test_the_cli_spends_what_the_api_does(ray_session, tmp_path, capsys):
    options = ["--set", "training.epochs=3", "--set", f"run.output_dir={tmp_path}"]
    assert main(["run", str(ROOT / "pipelines/quickstart.yaml"), *options]) == 0
    (run_dir,) = tmp_path.iterdir()
    epsilon = json.loads((run_dir / "privacy.json").read_text())["epsilon"]
    assert epsilon == pytest.approx(_quickstart_epsilon(3), rel=1e-9)
    printed = capsys.readouterr().out
    assert f"privacy spent           epsilon {epsilon:.4f}" in printed
    # The summary README.md shows for `make run`: each of its lines, as this run prints it.
    for label in output_labels(marked_block("README.md", "output")):
        assert f"\n{label}  " in printed or f"\n  {label}  " in printed, label


def test_the_api_names_stay_functions_once_every_module_is_loaded():
    """A submodule named like an API function would replace it on the package when imported."""

    for name in ("validate", "run", "tune", "load_model", "predict"):
        assert callable(getattr(rt, name)) and not isinstance(getattr(rt, name), type(rt)), name
    assert rt.Pipeline.from_yaml(ROOT / "pipelines/quickstart.yaml").name == "quickstart"


@pytest.mark.slow
def test_importing_the_package_imports_neither_torch_nor_ray():
    code = ("import sys, raydp_train; heavy = [m for m in ('torch', 'ray', 'transformers', "
            "'pydantic') if m in sys.modules]; print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stdout.strip() == "[]"


@pytest.mark.thorough
def test_validate_says_what_the_cli_prints_a_sweeps_epsilon_and_the_budget_left(tmp_path,
                                                                              capsys):
    options = [f"budget.ledger={tmp_path / 'ledger'}"]
    pipeline = rt.Pipeline.from_yaml(ROOT / "pipelines/sweep_digits.yaml", overrides=options)
    plan = rt.validate(pipeline)
    assert main(["validate", str(ROOT / "pipelines/sweep_digits.yaml"),
                 "--set", options[0]]) == 0
    printed = capsys.readouterr().out
    assert f"the sweep will spend    epsilon {plan.sweep_epsilon:.4f}" in printed
    assert f"budget left             epsilon {plan.budget_epsilon_left:.4f} of 10" in printed
    assert plan.budget_can_pay is (plan.sweep_epsilon <= 10)
    assert plan.sweep_epsilon > plan.epsilon() and plan.steps == plan.privacy.steps
    quickstart = rt.validate(rt.Pipeline.from_yaml(ROOT / "pipelines/quickstart.yaml"))
    assert (quickstart.sweep_epsilon, quickstart.budget_epsilon_left) == (None, None)


def test_the_reference_documents_exactly_the_public_names():
    """docs/reference/api.md's entries are the package's `__all__`, each from the module
    `import raydp_train` loads it from: nothing public undocumented, nothing internal shown."""
    import re

    documented = re.findall(r"^::: (raydp_train\.[\w.]+)\.(\w+)$",
                            (ROOT / "docs/reference/api.md").read_text(), re.MULTILINE)
    assert sorted(name for _, name in documented) == sorted(rt.__all__)
    assert all(rt._EXPORTS[name] == module for module, name in documented)
    assert all(getattr(rt, name) is not None for name in rt.__all__)
