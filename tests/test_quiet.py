"""Third-party output stays off the console unless `--verbose`: no Ray start-up
lines or token-authentication notice, no transformers load report, no progress bars.

Each check runs a fresh process: what is printed depends on what a process set up before it
imported Ray and transformers, which this test session did long ago."""

import os
import re
import subprocess
import sys

import pytest
from text_files import MINILM, text_pipeline

from raydp_train.commands.cli import _parser
from raydp_train.train.quiet import QUIET_ENVIRONMENT

THIRD_PARTY_LINES = ("Token authentication", "Started a local Ray instance", "LOAD REPORT",
                     "Loading weights", "Writing model shards", "Progress bars",
                     "Some weights of")
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's "100%|██████|"


def fresh_process(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """A Python process without the quieting this session's own commands may have set (nor
    a start-up concurrency of the user's own)."""
    env = {k: v for k, v in os.environ.items()
           if k not in QUIET_ENVIRONMENT and k != "RAY_worker_maximum_startup_concurrency"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.long
@pytest.mark.slow
def test_a_two_worker_text_run_prints_our_lines_only(tmp_path):
    """Ray Data tokenizes, transformers loads and saves the pretrained MiniLM, an embedded Ray
    starts (with token authentication on): the console shows none of it. Nor does the raylet
    warn ("N PYTHON worker processes have been started ... the maximum expected startup
    concurrency"), as it does when a run starts more processes than the machine has cores, as
    2 workers reading their Ray Data shards of a Parquet table do: the embedded Ray allows
    more concurrent starts."""
    pipeline = text_pipeline(tmp_path, trainable={"last_k_layers": 1})
    done = fresh_process("-m", "raydp_train", "run", pipeline, "--set", "training.workers=2",
                         cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    console = done.stdout + done.stderr
    for line in THIRD_PARTY_LINES:
        assert line not in console, console
    assert not PROGRESS_BAR.search(console), console
    assert "(raylet)" not in console and "startup concurrency" not in console, console
    assert "test accuracy" in done.stdout and "privacy spent" in done.stdout  # ours stay
    assert "2 worker(s)" in done.stdout


BUILD_MINILM = f"""
import sys
from raydp_train.train.quiet import quiet_third_party
quiet_third_party(verbose=sys.argv[1] == "verbose")
from raydp_train.models.hf import build_hf_model
from raydp_train.config.pipeline import HFModel
build_hf_model(HFModel(kind="hf", name_or_path="{MINILM}", num_labels=2), 2)
"""


@pytest.mark.slow
def test_verbose_leaves_transformers_its_load_report():
    quiet, verbose = (fresh_process("-c", BUILD_MINILM, mode) for mode in ("quiet", "verbose"))
    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert "LOAD REPORT" in verbose.stderr and "Loading weights" in verbose.stderr
    assert "LOAD REPORT" not in quiet.stderr and "Loading weights" not in quiet.stderr


@pytest.mark.parametrize("command", [
    ["validate", "p.yaml"], ["run", "p.yaml"], ["tune", "p.yaml"], ["audit", "p.yaml"],
    ["report", "runs/x"], ["budget", "status", "b", "--ledger", "l"],
    ["budget", "reset", "b", "--ledger", "l"]])
def test_every_command_takes_verbose_before_or_after_its_name(command):
    assert _parser().parse_args(["--verbose", *command]).verbose
    assert _parser().parse_args([*command, "--verbose"]).verbose
    assert not _parser().parse_args(command).verbose
