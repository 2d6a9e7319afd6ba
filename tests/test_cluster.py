"""Against a real `ray start --head` on loopback (its own ports and temporary directory, stopped
by the fixture): an embedded run beside it does not join it, and the README's cluster section
runs as written, with job submissions that spend from one budget.
"""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from ray_head import BIN, marked_processes, start_head, stop_head

from raydp_train.budget.ledger import as_uri
from raydp_train.budget.ledger_reading import budget_status

ROOT = Path(__file__).parents[1]
WALKTHROUGH_MARKER = "<!-- cluster walkthrough: tests/test_cluster.py runs these lines -->"
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def head():
    started = start_head()
    try:
        yield started
    finally:
        stop_head(started)


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """A copy of the working tree (tracked and new files), as a user's checkout."""
    copy = tmp_path_factory.mktemp("checkout")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for name in listed.splitlines():
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


def _jobs_seen_by(head) -> int:
    """Every job the head's GCS knows: submitted ones and drivers that joined it."""
    listed = subprocess.run([str(BIN / "ray"), "list", "jobs", "--address", head.dashboard,
                             "--format", "json"], env=head.env, capture_output=True, text=True,
                            timeout=300, check=True)
    if listed.stdout.startswith("No resource"):  # what `ray list` prints for none
        return 0
    return len(json.loads(listed.stdout))


# make test: every embedded run starts its own Ray (ensure_ray's address "local"); the head
# fixture still starts for the two tests below
@pytest.mark.long
def test_an_embedded_run_beside_a_head_node_does_not_join_it(head, tmp_path):
    before = _jobs_seen_by(head)
    # The head's address file is where this run's Ray looks (RAY_TMPDIR): a plain ray.init()
    # would join the head and refuse num_cpus there.
    run = subprocess.run(
        [str(BIN / "raydp-train"), "run", "pipelines/quickstart.yaml", "--set",
         "training.epochs=2", "--set", "training.workers=1", "--set",
         f"run.output_dir={tmp_path}"],
        env=head.env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "privacy spent" in run.stdout
    assert _jobs_seen_by(head) == before


def _walkthrough() -> list[str]:
    """The README's cluster commands, continuation lines joined, comments dropped."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split(WALKTHROUGH_MARKER, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#.*$", "", command).strip() for command in commands if command.strip()]


def _as_here(command: str, head) -> str:
    """The README line on the test's own head node and this environment's executables."""
    command = re.sub(r"(\$PWD/)?\.venv/bin/", f"{BIN}/", command)
    return (command.replace("http://127.0.0.1:8265", head.dashboard)
            .replace("127.0.0.1:6379", head.address))


def _shell(command: str, head, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=head.env, cwd=cwd, check=False,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.long
def test_readme_cluster_section_spends_one_budget_across_jobs(head, repository):
    commands = _walkthrough()
    assert commands[0] == "export RAY_AUTH_MODE=disabled"  # the fixture's head has it too
    # The head's own lines (start, its PID, the wait, the kill): the fixture's head stands
    # for them; test_the_readme_stops_its_own_head_and_no_other runs them.
    own_head = [c for c in commands if "ray-head." in c]
    assert own_head[0].startswith(".venv/bin/ray start --head") and own_head == [
        *commands[1:4], commands[-1]]
    sweep = next(c for c in commands if " tune " in c)
    for command in commands[4:-1]:
        done = _shell(_as_here(command, head), head, repository)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    assert "sweep-digits-sweep-" in done.stdout  # `budget status` (last) shows the job's sweep
    assert list((repository / "runs").glob("quickstart-*/record.json"))

    # Edit a file: the next job runs in another working-directory copy, same budget.
    (repository / "pipelines" / "sweep_digits.yaml").write_text(
        (repository / "pipelines" / "sweep_digits.yaml").read_text() + "# edited\n")
    after_first = budget_status("digits-sweep", str(repository / "budgets"))
    second = _shell(_as_here(sweep, head), head, repository)
    # The second job read the budget the first one spent (one budget, never exceeded): it
    # cannot pay one trial, so it stops before any, spending and writing nothing.
    assert "STOPPED before any trial: budget exhausted: 'digits-sweep' has epsilon" in (
        second.stdout + second.stderr), second.stdout[-3000:]
    assert budget_status("digits-sweep", str(repository / "budgets")) == after_first
    (sweep_dir,) = (repository / "runs").glob("sweep-digits-sweep-*")
    privacy = json.loads((sweep_dir / "sweep.json").read_text())["privacy"]
    assert privacy["ledger"] == as_uri(str(repository / "budgets"))
    assert after_first["epsilon_counted"] <= after_first["epsilon"]
    assert {owner.split("/")[0] for owner in after_first["owners"]} == {sweep_dir.name}


def test_the_readme_stops_its_own_head_and_no_other(head):
    """The README's head (`ray start --block` in the background, its PID kept) stops, all of
    it, by the README's `kill`, while the other head on this machine runs on."""
    commands = _walkthrough()
    assert "--block" in commands[1] and commands[-1] == "kill $(cat ray-head.pid)"
    own = start_head(num_cpus=1, block=True)
    try:
        (own.temp / "ray-head.pid").write_text(f"{own.blocking.pid}\n")
        started = marked_processes(str(own.temp))
        assert len(started) > 3  # the blocking start, GCS, raylet, dashboard, ...
        done = subprocess.run(["bash", "-c", commands[-1]], cwd=own.temp, check=False)
        assert done.returncode == 0
        own.blocking.wait(timeout=120)
        deadline = time.monotonic() + 60
        while marked_processes(str(own.temp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not marked_processes(str(own.temp))
        assert marked_processes(str(head.temp))  # the other head is untouched
        _jobs_seen_by(head)  # and still answers (check=True: raises if not)
    finally:
        stop_head(own)


def test_a_relative_ledger_in_a_job_working_dir_copy_is_refused(head, repository):
    command = _as_here(".venv/bin/ray job submit --address http://127.0.0.1:8265 --working-dir "
                       ". -- $PWD/.venv/bin/raydp-train tune pipelines/sweep_digits.yaml "
                       "--set budget.name=relative-ledger --set run.output_dir=$PWD/runs "
                       "--set budget.ledger=budgets", head)
    done = _shell(command, head, repository)
    assert done.returncode != 0
    assert "budget.ledger: 'budgets' is relative" in done.stdout + done.stderr
    assert "give an absolute path" in done.stdout + done.stderr
    assert not list(head.temp.glob("**/working_dir_files/*/budgets"))  # nothing written there
