"""Drafters: what proposes the tokens of the next draft tree, one module per source.

Every drafter meets the one :class:`~mlx_stream.drafters.base.Drafter` protocol
(``tree``, ``capture``, ``draft(hidden, tokens, ...)``; optionally ``propose`` for a tree
chosen per step, ``observe`` to learn from verification, ``observe_time``, ``coupled``
for drafts that follow the sampler's noise, ``draft_queued`` for steps queued ahead):

- :mod:`.base`: the protocol, :class:`NoDrafter`, :func:`propose` (how the loop asks any
  drafter for a step);
- :mod:`.stream_heads`: the stream heads' top-k (Speculative Streaming; Medusa, Hydra,
  multi-stream attention heads);
- :mod:`.eagle`: an EAGLE-style draft layer, static or EAGLE-2's dynamic tree;
- :mod:`.eagle3`: published EAGLE-3 checkpoints read as such a layer;
- :mod:`.dflash`: published DFlash block drafters, a static tree from one block forward;
- :mod:`.draft_model`: a separate draft model (Leviathan et al. 2023; Chen et al. 2023);
- :mod:`.lookup`: prompt lookup and the datastore's chains beside any drafter;
- :mod:`.oracle`: the target's own continuation (tests, the loop's ceiling).

Which drafter a model drafts with is decided in one place,
:func:`mlx_stream.speculation.plan_drafting` (the plan) and
:func:`~mlx_stream.speculation.build_drafter` (its builders, one per plan kind); which
steps may be queued ahead lives with the step pipeline (:mod:`mlx_stream.steps`); the tree
budgeted across these sources each step is :mod:`mlx_stream.budget`'s. Adding
a drafter is adding a module here and its line in the plan.

The names below are handed on lazily (importing a drafter loads only its own module).
"""

from importlib import import_module

_NAMES = {
    "Drafter": ".base",
    "TreeProposer": ".base",
    "AcceptanceObserver": ".base",
    "StepTimer": ".base",
    "NoDrafter": ".base",
    "propose": ".base",
    "proposes": ".base",
    "accepted_nodes": ".base",
    "topk": ".base",
    "HeadsDrafter": ".stream_heads",
    "EagleDrafter": ".eagle",
    "DynamicTreeDrafter": ".eagle",
    "select_dynamic_tree": ".eagle",
    "reranked_tree": ".eagle",
    "DraftModel": ".draft_model",
    "DraftCache": ".draft_model",
    "DraftModelDrafter": ".draft_model",
    "LookupDrafter": ".lookup",
    "OracleDrafter": ".oracle",
    "DFlashDrafter": ".dflash",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_NAMES[name], __name__), name)


def __dir__():
    return __all__
