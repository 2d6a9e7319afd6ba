"""training.threads_per_worker: how many threads torch computes with in a training process."""

import pytest
import torch

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.errors import UserError
from raydp_train.train.threads import available_cores, use_threads

QUICKSTART = "pipelines/quickstart.yaml"


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_auto_divides_the_cores_among_the_processes_sharing_them():
    assert use_threads("auto", sharing=1) == available_cores() == torch.get_num_threads()
    assert use_threads("auto", sharing=2) == max(1, available_cores() // 2)
    assert use_threads("auto", sharing=4 * available_cores()) == 1 == torch.get_num_threads()


def test_a_number_is_used_as_given():
    assert use_threads(3, sharing=64) == 3 == torch.get_num_threads()


@pytest.mark.parametrize("bad", [0, -1, "many", 1.5])
def test_a_bad_setting_is_refused_naming_the_field(bad):
    from raydp_train.config.pipeline import load_pipeline

    pipeline = load_pipeline(QUICKSTART).model_dump(mode="json")
    pipeline["training"]["threads_per_worker"] = bad
    with pytest.raises(UserError, match="threads_per_worker"):
        pipeline_from_dict(pipeline)
