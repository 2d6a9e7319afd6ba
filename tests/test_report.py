"""What `raydp-train report` and a sweep show: the table's validation column, the accuracy
plots' baselines, the accuracy-vs-epsilon plot, and the sweep's labelled privacy-utility plot.
The figures are read back through matplotlib's own artists (lines, legend, annotations)."""

import math

import pytest
import torch

from raydp_train.data.targets import LABEL_KINDS
from raydp_train.reports.plots import privacy_utility_figure, run_figures, trial_number
from raydp_train.reports.run import metrics_table


@pytest.fixture(autouse=True)
def close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def record(private: bool = True, validation: bool = True) -> dict:
    rows = []
    for epoch, (test, val, epsilon) in enumerate([(0.6, 0.62, 0.9), (0.7, 0.71, 1.3),
                                                  (0.8, 0.78, 1.6)], start=1):
        row = {"epoch": epoch, "steps": 10 * epoch, "steps_charged": 10 * epoch,
               "train_loss": 0.5, "test_accuracy": test, "epsilon": epsilon}
        if validation:
            row["validation_accuracy"] = val
        rows.append(row)
    return {"pipeline": {"name": "toy"}, "metrics": rows,
            "privacy": {"delta": 1e-5, "accountant": "rdp", "private": private},
            "baselines": {"chance": 0.5, "test_majority_class": 0.6}}


def legend(figure) -> list[str]:
    return [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_the_table_shows_validation_accuracy_when_the_run_has_it():
    table = metrics_table(record()).splitlines()
    assert "validation_accuracy" in table[0].split()
    assert table[0].split().index("validation_accuracy") == table[0].split().index(
        "test_accuracy") + 1
    assert table[2].split()[5] == "0.7100"
    assert "validation_accuracy" not in metrics_table(record(validation=False))


def test_accuracy_plots_show_both_splits_and_the_baselines():
    figures = run_figures(record())
    assert set(figures) == {"accuracy_vs_epoch.png", "accuracy_vs_epsilon.png",
                            "epsilon_vs_steps.png"}
    for name in ("accuracy_vs_epoch.png", "accuracy_vs_epsilon.png"):
        assert legend(figures[name]) == [
            "test accuracy", "validation accuracy", "chance (1/K): 0.500",
            "majority class of the test split: 0.600"]
        assert figures[name].axes[0].get_ylabel() == "accuracy (fraction correct)"
    by_epsilon = figures["accuracy_vs_epsilon.png"].axes[0]
    test_line, validation_line, chance, majority = by_epsilon.lines
    assert list(test_line.get_xdata()) == [0.9, 1.3, 1.6]  # epsilon spent after each epoch
    assert list(validation_line.get_ydata()) == [0.62, 0.71, 0.78]
    assert list(chance.get_ydata()) == [0.5, 0.5] and list(majority.get_ydata()) == [0.6, 0.6]
    assert by_epsilon.get_xlabel() == "epsilon spent (delta=1e-05, RDP)"


def test_a_non_private_run_has_no_epsilon_plots():
    assert set(run_figures(record(private=False))) == {"accuracy_vs_epoch.png"}


def test_the_baselines_come_from_the_test_labels_alone():
    labels = torch.tensor([0, 2, 2, 1, 2])
    classes = LABEL_KINDS["class"]
    counts = classes.baseline_sums(labels, 4).tolist()
    assert classes.baselines(counts) == {"chance": 0.25, "test_majority_class": 0.6}


def trial(number: int, epsilon: float, accuracy: float, stop: str = "completed") -> dict:
    return {"trial": f"3f2c1_{number:05d}", "epsilon": epsilon,
            "validation_accuracy": accuracy, "stop_reason": stop}


def test_the_privacy_utility_plot_labels_trials_stars_the_best_and_draws_the_budget():
    trials = [trial(0, 2.4, 0.81), trial(1, 3.1, 0.86), trial(2, 1.2, 0.7, "budget exhausted"),
              trial(3, 2.0, math.nan, "budget exhausted"), trial(4, 2.4, 0.812)]
    privacy = {"budget_epsilon": 10.0, "epsilon": 7.5, "delta": 1e-5, "accountant": "rdp"}
    figure = privacy_utility_figure(trials, "validation_accuracy", "sweep", trials[1], privacy,
                                    chance=0.1)
    axes = figure.axes[0]
    # trials 0 and 4 fall on one spot and share a label; trial 3 has no metric to show
    assert sorted(text.get_text() for text in axes.texts) == ["0, 4", "1", "2"]
    assert legend(figure) == [
        "trial: completed", "trial: budget exhausted", "best: trial 1",
        "global budget: epsilon 10", "the whole sweep spent: epsilon 7.500",
        "chance (1/K): 0.100"]
    budget_line = axes.lines[0]
    assert list(budget_line.get_xdata()) == [10.0, 10.0]
    best_marker = axes.collections[2]
    assert [list(p) for p in best_marker.get_offsets()] == [[3.1, 0.86]]


@pytest.mark.parametrize(("trial_id", "number"), [("3f2c1_00004", "4"), ("3f2c1_00120", "120"),
                                                  ("", ""), ("custom", "custom")])
def test_trial_numbers(trial_id, number):
    assert trial_number(trial_id) == number
