"""Every error in the user's input derives from `UserError` (the CLI prints it on one line and
exits 2) and survives pickling with its message, as it must to cross a Ray process boundary."""

import importlib
import pickle
import pkgutil

import pytest

import raydp_train
from raydp_train.config.errors import PipelineError
from raydp_train.errors import UserError
from raydp_train.train.own_loop_arguments import PrivateStepError

# Errors whose constructor takes more than one message, and an example of their arguments.
CONSTRUCTED = {PipelineError: ("pipeline.yaml", ("training.lr: must be > 0, got -1",)),
               PrivateStepError: ("clip_norm: must be > 0, got 0",)}


def user_errors() -> list[type[UserError]]:
    """Every UserError subclass the package defines (all its modules imported; no Ray started)."""
    for module in pkgutil.walk_packages(raydp_train.__path__, "raydp_train."):
        importlib.import_module(module.name)
    found, todo = set(), [UserError]
    while todo:
        for subclass in todo.pop().__subclasses__():
            if subclass.__module__.startswith("raydp_train.") and subclass not in found:
                found.add(subclass)
                todo.append(subclass)
    return sorted(found, key=lambda error: (error.__module__, error.__qualname__))


def test_the_user_errors_the_cli_caught_by_name_all_derive_from_user_error():
    names = {error.__name__ for error in user_errors()}
    assert names >= {
        "PipelineError", "DataError", "PlanError", "ModelError", "TrainingSetupError",
        "PrefixCacheError", "HFModelError", "UnsupportedLayerError", "LsgConfigError",
        "LoraSetupError", "BudgetError", "LedgerError", "ResourceError"}


@pytest.mark.parametrize("error_class", user_errors(), ids=lambda error: error.__name__)
def test_a_user_error_pickles_with_its_message(error_class):
    if error_class in CONSTRUCTED:
        error = error_class(*CONSTRUCTED[error_class])
    else:
        own_init = [k for k in error_class.__mro__ if "__init__" in vars(k)
                    and k.__module__.startswith("raydp_train.")]
        assert not own_init, (
            f"{error_class.__name__} takes more than a message: add an example to CONSTRUCTED "
            "(and make sure it rebuilds in __reduce__)")
        error = error_class("privacy.clip_norm: must be > 0, got 0")
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is error_class and str(restored) == str(error)
    assert isinstance(restored, UserError)
