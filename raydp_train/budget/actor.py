"""The budget accountant on Ray: found or created by name, restarted from its ledger.

The actor is created from the driver (an actor created inside a Tune trial dies with the
trial), one per budget name in the "raydp_train" namespace. `max_restarts=-1` brings it back
after a crash with its state read from the ledger, and `max_task_retries=-1` re-sends calls
that were in flight; `reserve` and `settle` carry a request id so a re-sent call is answered,
not done twice. Workers hold a `BudgetClient`, which finds the actor by name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import ray

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.book import NAMESPACE, Decision
from raydp_train.budget.ledger import LedgerError, as_uri
from raydp_train.budget.terms import BudgetError, BudgetTerms, Spend

# A resource Ray puts on the head node alone (and on a local Ray's one node).
HEAD_NODE_RESOURCE = "node:__internal_head__"
# Every handle this driver opened. A non-detached actor lives while the handle that created it
# lives; a handle found by name does not keep it alive, so none is ever dropped here.
_OPENED: list = []


def actor_name(budget: str) -> str:
    return f"budget:{budget}"


def budget_terms(config, unit: str = "example") -> BudgetTerms:
    """The terms a pipeline's `budget` section asks for, per `unit` (privacy.unit)."""
    return BudgetTerms(config.name, config.epsilon, config.delta, config.accountant, unit)


def open_budget(config, unit: str = "example") -> BudgetClient:
    """Find or create the accountant of `config` (a pipeline's budget section) and check that
    its terms (its unit: privacy.unit) and ledger are the ones asked for. Call from the
    driver."""
    if unit not in ("example", "user"):
        raise BudgetError(f"unit: what a budget's epsilon protects, 'example' or 'user' "
                          f"(privacy.unit), got {unit!r}")
    return _open(budget_terms(config, unit), as_uri(config.ledger), config.persist_across_jobs)


def open_existing_budget(name: str, ledger: str) -> BudgetClient:
    """The accountant of a budget that already has a ledger, on the terms it was created with."""
    from raydp_train.budget.book import terms_of
    from raydp_train.budget.ledger_reading import ledger_rows

    return _open(terms_of(ledger_rows(name, ledger)[0]), as_uri(ledger), detached=False)


def _open(terms: BudgetTerms, ledger_root: str, detached: bool) -> BudgetClient:
    options = {
        "name": actor_name(terms.name),
        "namespace": NAMESPACE,
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": -1,
        "num_cpus": 0,
        # On the head node: it lives as long as the cluster, where a worker node may go.
        "resources": {HEAD_NODE_RESOURCE: 0.001},
    }
    if detached:
        options["lifetime"] = "detached"
    actor = ray.remote(BudgetAccountant).options(**options).remote(ledger_root, terms)
    try:
        ray.get(actor.check_terms.remote(terms, ledger_root))
    except (BudgetError, LedgerError) as error:
        # Raised in the actor: show its message, not the remote traceback Ray wraps it in.
        raise getattr(error, "cause", error) from None
    _OPENED.append(actor)
    return BudgetClient(terms.name, terms.unit)


@dataclass(frozen=True)
class BudgetClient:
    """A handle for spending from a budget; pickles by name, so it travels to workers."""

    budget: str
    unit: str = "example"  # what its epsilon protects (privacy.unit): a loop checks its own

    def reserve(self, owner: str, spend: Spend, request_id: str = "") -> Decision:
        """`request_id`: the caller's own id for this request, recorded before asking, so that
        a restart can close what a dead attempt reserved (`close_requests`)."""
        return ray.get(self._actor().reserve.remote(request_id or uuid.uuid4().hex, owner,
                                                    spend))

    def close_requests(self, closings: list[tuple[str, int, int]]) -> int:
        """Settle the open reservations of these reserve requests with what they used."""
        return ray.get(self._actor().close_requests.remote(closings))

    def settle(self, decision: Decision, steps_done: int, releases_done: int = 0) -> int:
        """Close a granted reservation; returns the steps given back to the budget."""
        return ray.get(self._actor().settle.remote(
            uuid.uuid4().hex, decision.reservation, steps_done, releases_done))

    def status(self) -> dict:
        return ray.get(self._actor().status.remote())

    def epsilon_of(self, owner: str) -> float:
        return ray.get(self._actor().epsilon_of.remote(owner))

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the ledger's newest row: a run record's witness of the ledger."""
        return tuple(ray.get(self._actor().head.remote()))

    def reset(self, note: str) -> dict:
        """Append a reset row (settled spending stops counting); returns the new status."""
        return ray.get(self._actor().reset.remote(uuid.uuid4().hex, note))

    def _actor(self):
        return ray.get_actor(actor_name(self.budget), namespace=NAMESPACE)
