"""raydp_train: differentially private training pipelines on Ray.

    import raydp_train as rt
    result = rt.run(rt.Pipeline.from_yaml("pipelines/quickstart.yaml"))

The names below load on first use (api.py), so `import raydp_train` imports neither torch
nor Ray.
"""

from importlib import import_module

_EXPORTS = {
    "Pipeline": "raydp_train.config.pipeline",
    "validate": "raydp_train.api",
    "run": "raydp_train.api",
    "tune": "raydp_train.api",
    "RunResult": "raydp_train.api",
    "Plan": "raydp_train.api",
    "open_budget": "raydp_train.api",
    "PrivateStep": "raydp_train.train.own_loop",
    "BudgetExhausted": "raydp_train.train.own_loop",
    "load_model": "raydp_train.models.predictions",
    "predict": "raydp_train.models.predictions",
    "UserError": "raydp_train.errors",
    "fix": "raydp_train.privacy.fixes",
    "register_rule": "raydp_train.privacy.rule_registry",
    "Rule": "raydp_train.privacy.rule_registry",
    "check_rule": "raydp_train.privacy.self_check",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raydp_train' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
