"""The suite's tiers: a test that starts a process says so with a marker (tests/conftest.py),
so `make test-fast` never starts one."""

import multiprocessing
import subprocess

import pytest
from conftest import UndeclaredProcess


def test_a_subprocess_from_an_unmarked_test_is_refused_by_name():
    with pytest.raises(UndeclaredProcess, match="mark it @pytest.mark.slow"):
        subprocess.run(["true"], check=True)


def test_a_multiprocessing_child_from_an_unmarked_test_is_refused():
    with pytest.raises(UndeclaredProcess, match="test_suite_tiers"):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.slow
def test_a_marked_test_starts_its_process():
    assert subprocess.run(["true"], check=True).returncode == 0
