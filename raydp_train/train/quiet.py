"""Third-party chatter stays off the console unless `--verbose`: transformers' load reports and
progress bars, Hugging Face Hub progress bars, Ray's start-up lines and its token-authentication
notice, and the warnings libraries raise about their own internals. Our own output and warnings
(FeatureScaleWarning, privacy notes, errors) are never touched."""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Read by transformers, huggingface_hub and Ray Data when they are imported: in this process,
# and in the Ray workers that an embedded Ray starts from it (they inherit its environment).
QUIET_ENVIRONMENT = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' own bars follow this one
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    "RAY_DATA_LOG_LEVEL": "ERROR",  # Ray Data's logger prints to the console on its own
}
# Warnings raised from inside these libraries (deprecations, internals) are theirs to fix.
THIRD_PARTY_MODULES = (r"(torch|transformers|huggingface_hub|tokenizers|ray|pyarrow|sklearn|"
                       r"scipy|dp_accounting|pydantic)(\.|$)")


def quiet_third_party(verbose: bool) -> None:
    """Silence third-party output for this process and the Ray workers it starts; `verbose`
    leaves every library as it is."""
    if verbose:
        return
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)  # a user's own setting wins
    warnings.filterwarnings("ignore", module=THIRD_PARTY_MODULES)
    if "transformers" in sys.modules:  # imported before the environment was set
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()


def ray_logging_level(verbose: bool) -> int:
    """For `ray.init(logging_level=...)`, the driver's "ray" logger: ERROR hides Ray's start-up
    lines and the token-authentication notice it logs as a WARNING on every local start while
    RAY_AUTH_MODE is unset (the authentication itself is unchanged)."""
    return logging.INFO if verbose else logging.ERROR
