"""What a model drafts with, decided in one place.

:func:`plan_drafting` reads the user's choices (tree spec, prompt lookup, datastore,
sampled or not) against the model once: the spec and the heads' candidate trees are
parsed there and nowhere else, into a :class:`DraftPlan`. :func:`build_drafter` turns
a plan into the drafter, taking this device's measured costs from their one owner
(:func:`mlx_stream.cost.device_costs`) only where the plan needs them (``"auto"``,
``"dynamic:auto"``, ``"budget"``). :func:`make_drafter` is the two in one call, and
:func:`resolve_tree` a plan's static tree.

``tree="auto"`` (:func:`auto_tree`): a tree of N drafted nodes is worth its expected
tokens per forward pass, tau (the heads' held-out acceptance, measured at training:
``HeadConfig.tree_taus``), divided by what a step with it costs relative to a plain
step on this device: the (N+1)-token forward's cost c(N+1) plus the time to draft
the tree. tau / cost is the speedup the tree would give if the loop had no other
overhead (Medusa's tree choice, Cai et al. 2024, sec. 2.1.2, with the device's
measured cost model in place of a fixed budget; cf. Sequoia, Chen et al. 2024). The
costs depend on the device, the dtype and the BLAS, so they are measured once per
model + heads + device and cached; the choice from them is cheap and made anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .budget import BudgetDrafter, head_values
from .checks import check_p_min, kind, require_int
from .cost import StepCosts, device_costs
from .defaults import AUTO_TREE, BUDGET_TREE, PROMPT_LOOKUP
from .drafters.base import Drafter, NoDrafter
from .drafters.dflash import DFlashDrafter
from .drafters.eagle import DynamicTreeDrafter, EagleDrafter
from .drafters.lookup import LookupDrafter
from .drafters.stream_heads import HeadsDrafter
from .model import require_model
from .tree import Tree, check_ranks, check_tree_syntax, format_tree, no_drafts, parse_tree

TreeSpec = str | Sequence[Sequence[int]] | Tree | None


def is_auto(spec: TreeSpec) -> bool:
    """Whether ``spec`` asks for the tree measured fastest on this device."""
    return isinstance(spec, str) and spec.strip() == AUTO_TREE


def is_budget(spec: TreeSpec) -> bool:
    """Whether ``spec`` asks for the tree budgeted per step across sources
    (:class:`~mlx_stream.budget.BudgetDrafter`)."""
    return isinstance(spec, str) and spec.strip() == BUDGET_TREE


def dynamic_spec(spec: TreeSpec) -> tuple[int, int, int] | None:
    """``(budget, width, depth)`` of a dynamic-tree spec (``"dynamic:N"``,
    ``"dynamic:N,W"`` or ``"dynamic:N,W,D"``: EAGLE-2's budgeted dynamic tree of at most N
    nodes (its ``total_token``), W children per expanded node (its ``top_k``, default 4),
    at most D deep (its ``depth``; 0, the default: the heads' depth, or a draft model's
    calibrated or default depth)), or ``None`` for any other spec. ``"dynamic:auto[,W[,D]]"``
    gives budget 0: N is chosen on this device (:func:`make_drafter`).

    Raises:
        ValueError: a malformed dynamic spec.
    """
    if not isinstance(spec, str) or not spec.strip().startswith("dynamic"):
        return None
    body = spec.strip()[len("dynamic") :]
    try:
        if not body.startswith(":"):
            raise ValueError
        parts = body[1:].split(",")
        nums = [0 if parts[0].strip() == "auto" else int(parts[0])] + [int(x) for x in parts[1:]]
        if len(nums) not in (1, 2, 3) or nums[0] == 1 or nums[0] < 0 or any(x < 1 for x in nums[1:]):
            raise ValueError
        if nums[0] == 0 and parts[0].strip() != "auto":
            raise ValueError
    except ValueError:
        raise ValueError(
            f"bad dynamic tree spec {spec!r}: use dynamic:N (N >= 2 nodes, root included), "
            "dynamic:N,W (W >= 1 children per expanded node), dynamic:N,W,D (at most D >= 1 deep) "
            "or dynamic:auto[,W[,D]]"
        ) from None
    budget, width, depth = nums + [4, 0][len(nums) - 1 :]
    return budget, width, depth


def check_tree_spec(spec: TreeSpec) -> None:
    """Check a tree spec's syntax before any model is loaded (its depth is checked
    against the heads by :func:`resolve_tree`).

    Raises:
        ValueError: a malformed spec (see :func:`~mlx_stream.tree.parse_tree` and
            :func:`dynamic_spec`).
    """
    if spec is not None and not is_auto(spec) and not is_budget(spec) and dynamic_spec(spec) is None:
        try:
            check_tree_syntax(spec)
        except ValueError as e:
            raise ValueError(f"{e}; or '{AUTO_TREE}', '{BUDGET_TREE}', 'dynamic:N[,W[,D]]'") from None


def check_prompt_lookup(prompt_lookup: int | None) -> None:
    """Raise ``ValueError`` unless ``prompt_lookup`` is ``None`` or an integer >= 0."""
    if prompt_lookup is not None and (
        isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) or prompt_lookup < 0
    ):
        raise ValueError(f"prompt_lookup must be an integer >= 0 (0: off) or None, got {prompt_lookup!r}")


def candidate_trees(heads) -> list[tuple[Tree, float]]:
    """The heads' candidate trees, parsed once: ``(tree, tau)`` for each entry of
    ``HeadConfig.tree_taus`` (written by ``mlx-stream train``: the held-out tokens per
    forward of each tree), in the order of their specs; empty without heads or
    candidates.

    Raises:
        ValueError: a stored tree deeper than the heads or malformed (a damaged config).
    """
    if heads is None:
        return []
    taus = heads.config.tree_taus or {}
    return [(parse_tree(t, heads.num_heads), float(tau)) for t, tau in sorted(taus.items()) if t != "none"]


def score_trees(candidates: Sequence[tuple[Tree, float]], costs: StepCosts) -> dict:
    """Score candidate trees by this device's measured costs.

    Args:
        candidates: ``(tree, tau)`` pairs (tau: expected tokens per forward pass).
        costs: the device's :class:`~mlx_stream.cost.StepCosts`, with the drafting
            time of each candidate's size (:func:`~mlx_stream.cost.device_costs`).

    Returns:
        ``{"best": i, "t1_ms": ..., "sizes": [{"tree", "nodes", "tau", "cost", "draft_ms",
        "speedup_bound"}, ...]}`` in the order of ``candidates``; ``cost`` is c(N+1) plus
        the drafting time in units of a 1-token forward, ``speedup_bound = tau / cost``.
    """
    sizes = []
    for tree, tau in candidates:
        cost = costs.step([tree.size - 1])
        sizes.append(
            {
                "tree": format_tree(tree) or "none",
                "nodes": tree.size - 1,
                "tau": tau,
                "cost": cost,
                "draft_ms": costs.draft_ms.get(tree.size - 1, 0.0),
                "speedup_bound": tau / cost,
            }
        )
    best = max(range(len(sizes)), key=lambda i: sizes[i]["speedup_bound"])
    return {"best": best, "t1_ms": costs.t1_ms, "sizes": sizes}


def auto_tree(
    model,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
    candidates: Sequence[tuple[Tree, float]] | None = None,
) -> tuple[Tree, dict]:
    """The tree among the heads' candidates with the best tau / cost on this device.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel` whose heads carry
            ``config.tree_taus`` (written by ``mlx-stream train``).
        cache_dir: where the measured costs are kept (default:
            :func:`mlx_stream.loader.cache_dir` / ``costs``; :func:`~mlx_stream.cost.device_costs`).
        refresh: measure the costs again even when they are cached.
        candidates: the heads' parsed candidates (:func:`candidate_trees`; the drafting
            plan passes its own); None parses them here.

    Returns:
        ``(tree, info)``: ``info`` is :func:`score_trees`'s result plus ``cached``
        (whether the costs came from the cache). Plain decoding (the root-only tree,
        tau 1) is always a candidate: no tree may pay on this device.

    Raises:
        ValueError: no heads, or heads without candidate trees (retrain them, or pass a tree).
    """
    if model.heads is None:
        raise ValueError("tree='auto' chooses among the heads' trees: load heads first")
    if candidates is None:
        candidates = candidate_trees(model.heads)
    if not candidates:
        raise ValueError(
            "these heads carry no candidate trees (config.json 'tree_taus', written by "
            "`mlx-stream train`); pass a tree such as '0;1;0,0' instead of 'auto'"
        )
    by_size = {t.size: t for t, _ in candidates}  # drafting time is measured once per size
    costs = device_costs(model, [by_size[n] for n in sorted(by_size)], cache_dir, refresh)
    scored = [(no_drafts(), 1.0)] + list(candidates)
    info = score_trees(scored, costs) | {"cached": costs.cached}
    return scored[info["best"]][0], info


@dataclass(frozen=True)
class DraftPlan:
    """How a model drafts, decided once (:func:`plan_drafting`); every tree in it parsed.

    Attributes:
        kind: ``"none"`` (no heads: prompt lookup alone, or plain decoding),
            ``"static"`` (the heads fill :attr:`tree`), ``"auto"`` (the candidate with
            the best tau / cost here), ``"dynamic"`` (EAGLE-2's dynamic tree of
            :attr:`budget` nodes, 0: chosen here, :attr:`width` children per node,
            :attr:`depth` deep, 0: the heads' depth) or
            ``"budget"`` (:class:`~mlx_stream.budget.BudgetDrafter`), ``"draft"`` (a
            separate draft model's tree, :class:`~mlx_stream.drafters.draft_model.DraftModelDrafter`:
            :attr:`budget` nodes, :attr:`width` children per expanded node,
            :attr:`depth` deep, :attr:`expand` nodes expanded per depth, expansion
            stopping below :attr:`p_min`).
        tree: the static tree (``"static"``), the heads' stored tree (``"budget"``'s
            base), else None.
        candidates: the heads' candidate trees and held-out taus, parsed
            (:func:`candidate_trees`); read by ``"auto"``,
            ``"dynamic"`` with budget 0 and ``"budget"``.
        prompt_lookup: the most tokens prompt lookup copies per step (0: off).
        store: the datastore beside prompt lookup, or None.
        spec: the spec as given, for messages.
        draft: the :class:`~mlx_stream.drafters.draft_model.DraftModel` (``"draft"``).
    """

    kind: str
    tree: Tree | None = None
    candidates: tuple = ()
    budget: int = 0
    width: int = 4
    prompt_lookup: int = 0
    store: object = None
    spec: object = None
    draft: object = None
    depth: int = 0
    p_min: float = 0.0
    expand: int = 1

    @property
    def measures_costs(self) -> bool:
        """Whether building the drafter reads this device's measured costs."""
        return self.kind in ("auto", "budget") or (self.kind == "dynamic" and self.budget == 0)


def plan_drafting(
    model,
    tree: TreeSpec = None,
    prompt_lookup: int | None = None,
    store=None,
    sampled: bool = False,
    draft_model=None,
    num_draft_tokens: int | None = None,
) -> DraftPlan:
    """Read the drafting choices against ``model`` once: the :class:`DraftPlan`.

    Args: as :func:`make_drafter`.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: a bad tree spec or ``prompt_lookup``, a tree deeper than the heads,
            a dynamic tree without eagle heads, ``"budget"`` with eagle heads, or any
            drafting on a model whose draft trees failed the load-time self-check
            (:func:`build_drafter` refuses ``"auto"`` where the heads carry no
            candidate trees).
    """
    require_model(model)
    check_prompt_lookup(prompt_lookup)
    if not isinstance(sampled, bool):
        raise TypeError(f"sampled must be True or False, got {kind(sampled)}")
    if store is not None and store is not False and not hasattr(store, "lookup"):
        raise TypeError(
            f"store must be a Datastore or DraftStore, None (the model's own) or False, got {kind(store)}"
        )
    if num_draft_tokens is not None:
        require_int(num_draft_tokens, "num_draft_tokens", 1)
    off = getattr(model.family, "trees", None)  # the load-time self-check's verdict
    if off is not None and (
        model.heads is not None or draft_model is not None or prompt_lookup or is_budget(tree)
    ):
        raise ValueError(
            f"this model decodes plainly only: {off}; leave out heads, draft_model and prompt_lookup"
        )
    if (
        tree is None
        and model.heads is not None
        and draft_model is None
        and getattr(model.family, "recurrent", False)
    ):
        # a recurrent hybrid's tree step reads N x N tokens in each recurrent mixer (one row per
        # node's path): the heads' chain unless a tree is asked for (docs/benchmarks.md)
        tree = f"chain:{model.heads.num_heads}"
    heads = model.heads
    if store is None:
        store = getattr(model, "datastore", None)
    store = store or None
    if prompt_lookup is None:
        drafts = heads is not None or is_budget(tree) or draft_model is not None
        prompt_lookup = PROMPT_LOOKUP if drafts else 0
    common = {"prompt_lookup": prompt_lookup, "store": store, "spec": tree}
    if draft_model is not None:
        plan = _draft_model_plan(draft_model, tree, num_draft_tokens, common)
        hybrid = getattr(model.family, "recurrent", False) and tree is None  # (a tree step reads N x N there)
        if (draft_model.recurrent or hybrid) and plan.kind == "draft":  # its tree's depth, as a chain
            plan = replace(plan, budget=plan.depth + 1, width=1, expand=1)
        return plan
    if num_draft_tokens is not None:
        raise ValueError("num_draft_tokens sets a draft model's chain: pass draft_model too")
    if heads is not None and heads.config.architecture == "dflash" and (is_budget(tree) or is_auto(tree)):
        raise ValueError(
            f"{tree!r}: a DFlash drafter fills a static tree from one block forward: pass a chain "
            "('chain:K') or rank paths such as '0;1;0,0' (default: a chain of block_size - 1)"
        )
    if is_budget(tree):
        if heads is not None and heads.autoregressive:
            raise ValueError(
                "the budgeted tree ('budget') drafts from heads that read one hidden state; these are "
                "eagle heads: use a static tree or 'dynamic:N'"
            )
        base = parse_tree(stored_tree(model), heads.num_heads) if heads is not None else None
        return DraftPlan("budget", base, tuple(candidate_trees(heads)), **common)
    if tree is None:
        tree = stored_tree(model, sampled)
    if heads is None:
        # a malformed spec is refused with or without heads (no preset is built: "sparse"
        # over 1 << 10 "heads" took ~0.3 s a call)
        if dynamic_spec(tree) is None and not is_auto(tree):
            check_tree_syntax(tree)
        return DraftPlan("none", **common)
    dyn = dynamic_spec(tree)
    if dyn is not None:
        if not heads.autoregressive:
            raise ValueError(
                f"a dynamic tree ({tree!r}) needs eagle heads (an EAGLE-style draft layer); "
                f"these heads are {heads.config.architecture!r}: use a static tree"
            )
        if dyn[1] > model.args.vocab_size:
            raise ValueError(
                f"{tree!r}: {dyn[1]} children a node, more than the vocabulary's "
                f"{model.args.vocab_size} tokens"
            )
        if dyn[2] > heads.num_heads:
            raise ValueError(f"{tree!r} drafts {dyn[2]} deep; these heads draft at most {heads.num_heads}")
        cands = tuple(candidate_trees(heads)) if dyn[0] == 0 else ()
        return DraftPlan("dynamic", None, cands, dyn[0], dyn[1], depth=dyn[2], **common)
    if is_auto(tree):
        return DraftPlan("auto", None, tuple(candidate_trees(heads)), **common)
    static = parse_tree(tree, heads.num_heads)
    check_ranks(static, model.args.vocab_size)
    return DraftPlan("static", static, **common)


def _draft_model_plan(draft, tree, num_draft_tokens, common) -> DraftPlan:
    from .drafters.draft_model import DRAFT_TREE, DraftModel

    if not isinstance(draft, DraftModel):
        raise TypeError(
            "draft_model must be a DraftModel (mlx_stream.load(..., draft_model=SPEC) or "
            f"mlx_stream.load_draft(SPEC, model, tokenizer)), got {type(draft).__name__}"
        )
    if num_draft_tokens is not None:
        if (
            isinstance(num_draft_tokens, bool)
            or not isinstance(num_draft_tokens, int)
            or num_draft_tokens < 1
        ):
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
        if tree is not None:
            raise ValueError("pass either num_draft_tokens (a chain) or a tree for the draft model, not both")
        k = num_draft_tokens
        p_min = _p_min(draft, chain=True)
        return DraftPlan(
            "draft", budget=k + 1, width=1, depth=k, p_min=p_min, draft=draft, expand=1, **common
        )
    budget, width, depth = DRAFT_TREE
    dyn = dynamic_spec(tree)
    if dyn is not None and dyn[0] == 0:
        raise ValueError(f"{tree!r}: a draft model's tree takes a node budget: dynamic:N[,W[,D]]")
    if dyn is not None:  # the size asked for; as deep as measured to pay, else the default depth
        budget, width = dyn[:2]
        if width > draft.vocab:
            raise ValueError(f"{tree!r}: {width} children a node, more than the draft's {draft.vocab} tokens")
        depth = dyn[2] or draft.depth or depth
    elif draft.depth is not None:  # measured on this device (mlx_stream.calibrate)
        if draft.depth == 0:
            return DraftPlan("none", **common)  # drafting does not pay here: plain decoding
        budget, depth = draft.budget, draft.depth
        width = 2 if budget > depth + 1 else 1
    if tree is not None and dyn is None:
        raise ValueError(
            f"a draft model drafts its own tree: tree must be None, 'dynamic:N[,W[,D]]' (N nodes, W children "
            f"per expanded node, D deep) or num_draft_tokens=K (a chain), got {tree!r}"
        )
    return DraftPlan(
        "draft",
        budget=budget,
        width=width,
        depth=depth,
        p_min=_p_min(draft),
        draft=draft,
        expand=draft.expand_for(width),
        **common,
    )


def _p_min(draft, chain: bool = False) -> float:
    from .drafters.draft_model import P_MIN

    check_p_min(draft.p_min)  # an attribute a caller may set
    if draft.p_min is None:  # an explicit chain of K drafts K (mlx-lm's num_draft_tokens)
        return 0.0 if chain else P_MIN
    return float(draft.p_min)


def build_drafter(model, plan: DraftPlan, costs=None, draft_cache=None) -> Drafter:
    """The drafter a :class:`DraftPlan` describes, with prompt lookup's chain beside the
    heads' tree where the plan has it on.

    Args:
        model: the model the plan was made for.
        plan: :func:`plan_drafting`'s result.
        costs: this device's :class:`~mlx_stream.cost.StepCosts` for the plan's
            candidates; None: :func:`~mlx_stream.cost.device_costs` (measured once,
            then cached) where :attr:`DraftPlan.measures_costs`.
        draft_cache: the draft model's :class:`~mlx_stream.drafters.draft_model.DraftCache`
            (``"draft"``; :meth:`mlx_stream.generate.PromptCache.draft_cache` keeps one
            per prompt cache); None: a fresh one.

    Raises:
        TypeError: ``model`` is not a SpeculativeModel, ``plan`` not a DraftPlan, or
            ``costs`` not StepCosts.
    """
    require_model(model)
    if not isinstance(plan, DraftPlan):
        raise TypeError(f"plan must be a DraftPlan (mlx_stream.plan_drafting(model, ...)), got {kind(plan)}")
    if costs is not None and not isinstance(costs, StepCosts):
        raise TypeError(f"costs must be StepCosts (mlx_stream.cost.device_costs) or None, got {kind(costs)}")
    drafter = _BUILDERS[plan.kind](model, plan, costs, draft_cache)
    if plan.kind == "budget":  # (it grafts prompt lookup's and the datastore's chains itself)
        return drafter
    if plan.prompt_lookup:
        return LookupDrafter(drafter, plan.prompt_lookup, store=plan.store)
    return drafter


# One builder per DraftPlan kind: (model, plan, costs, draft_cache) -> the drafter (before
# prompt lookup joins it). A new drafter is a module in mlx_stream/drafters/, a kind in
# plan_drafting and its line here.


def _no_drafter(model, plan, costs, draft_cache) -> Drafter:
    return NoDrafter()


def _heads_drafter(model, plan, costs, draft_cache) -> Drafter:
    tree = plan.tree if plan.kind == "static" else _best_tree(model, plan, costs)
    if model.heads.config.architecture == "dflash":
        return DFlashDrafter(model, tree)
    return (EagleDrafter if model.heads.autoregressive else HeadsDrafter)(model, tree)


def _dynamic_drafter(model, plan, costs, draft_cache) -> Drafter:
    budget = plan.budget
    if budget == 0:  # the node budget whose best static tree pays most here (EAGLE-2's N from c(N))
        budget = _best_tree(model, plan, costs).size
    if budget < 2:
        return EagleDrafter(model, no_drafts())
    return DynamicTreeDrafter(model, budget, plan.width, min(plan.depth, budget - 1) or None)


def _draft_model_drafter(model, plan, costs, draft_cache) -> Drafter:
    from .drafters.draft_model import DraftCache, DraftModelDrafter

    cache = draft_cache if draft_cache is not None else DraftCache(plan.draft)
    return DraftModelDrafter(cache, plan.budget, plan.width, plan.depth, plan.p_min, expand=plan.expand)


def _budget_drafter(model, plan, costs, draft_cache) -> Drafter:
    if costs is None:
        costs = device_costs(model, [t for t, _ in head_values(plan.candidates)])
    base = HeadsDrafter(model, plan.tree) if plan.tree is not None else NoDrafter()
    return BudgetDrafter(
        model,
        costs,
        base,
        num_draft=max(plan.prompt_lookup, 1),
        store=plan.store,
        chains=plan.prompt_lookup > 0,
        candidates=plan.candidates,
    )


_BUILDERS = {
    "none": _no_drafter,
    "static": _heads_drafter,
    "auto": _heads_drafter,
    "dynamic": _dynamic_drafter,
    "draft": _draft_model_drafter,
    "budget": _budget_drafter,
}


def _best_tree(model, plan: DraftPlan, costs) -> Tree:
    if costs is None:
        return auto_tree(model, candidates=plan.candidates)[0]
    scored = [(no_drafts(), 1.0)] + list(plan.candidates)
    return scored[score_trees(scored, costs)["best"]][0]


def resolve_tree(model, spec: TreeSpec = None) -> Tree:
    """The draft tree a spec names for ``model``.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel`.
        spec: ``None``: the tree stored with the heads (``HeadConfig.tree``, chosen at
            training), else the default sparse tree; ``"auto"``: the heads' candidate
            with the best expected speed on this device (:func:`auto_tree`,
            measured once, then cached); a preset (``"sparse"``, ``"chain"``,
            ``"chain:K"``, ``"none"``), rank paths such as ``"0;1;0,0"``, a list of paths
            or a :class:`~mlx_stream.tree.Tree` (:func:`~mlx_stream.tree.parse_tree`).
            Dynamic trees (``"dynamic:N"``, :func:`dynamic_spec`) have no static shape
            and are refused here; :func:`make_drafter` builds them.
            Without heads, ``None`` is the root-only tree and other specs are not
            limited in depth (a custom drafter fills them).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: a malformed spec, a tree deeper than the loaded heads, ``"auto"``
            without heads that carry candidate trees, or a dynamic tree.
    """
    require_model(model)
    if dynamic_spec(spec) is not None or is_budget(spec):
        raise ValueError(
            f"{spec!r} is a dynamic tree (its shape changes every step): use it with make_drafter or "
            "stream_generate, not as a static tree"
        )
    if is_auto(spec) and model.heads is None:
        return auto_tree(model)[0]  # refused: it says to load heads
    if model.heads is None:
        return no_drafts() if spec is None else parse_tree(spec, 1 << 10)
    plan = plan_drafting(model, spec, prompt_lookup=0, store=False)
    return plan.tree if plan.kind == "static" else _best_tree(model, plan, None)


def stored_tree(model, sampled: bool = False) -> str | None:
    """The tree spec ``model``'s heads store for greedy decoding (their config's ``tree``)
    or for sampling (``sampled_tree``, else ``tree``): what ``tree=None`` drafts; None
    without heads or without a stored tree (then the heads' default tree)."""
    if model.heads is None:
        return None
    cfg = model.heads.config
    return (cfg.sampled_tree if sampled and cfg.sampled_tree else cfg.tree) or None


def make_drafter(
    model,
    tree: TreeSpec = None,
    prompt_lookup: int | None = None,
    store=None,
    sampled: bool = False,
    draft_model=None,
    num_draft_tokens: int | None = None,
    draft_cache=None,
) -> Drafter:
    """The drafter for ``model``: its stream heads filling ``tree`` (or nothing without
    heads), with prompt lookup's chain beside them.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel`.
        tree: a tree spec (:func:`resolve_tree`), ``"dynamic:N[,W[,D]]"`` for EAGLE-2's
            dynamic tree (:class:`~mlx_stream.drafters.eagle.DynamicTreeDrafter`, eagle heads
            only; ``"dynamic:auto[,W]"``: N is the size of the heads' candidate tree with
            the best tau / cost on this device, :func:`auto_tree`,
            and a plain step when no tree pays), or ``"budget"``: each step's tree
            budgeted across the heads' candidate trees, prompt lookup and the
            datastore by estimated acceptance and this device's measured costs
            (:class:`~mlx_stream.budget.BudgetDrafter`; the costs are measured once
            per device and cached); ignored without heads, except ``"budget"``.
        prompt_lookup: the most tokens copied from the context per step
            (:class:`~mlx_stream.drafters.lookup.LookupDrafter`); 0 turns it off; ``None``:
            :data:`PROMPT_LOOKUP` with heads, 0 without.
        store: a :class:`~mlx_stream.datastore.Datastore` (or
            :class:`~mlx_stream.datastore.DraftStore`) whose chains stand in where the
            context has no match (only with prompt lookup on); ``None``: the model's
            own (``model.datastore``: the heads' store and this machine's answers);
            ``False``: none.
        sampled: the drafts serve sampled decoding (temperature > 0): ``tree=None`` is
            then the heads' ``sampled_tree`` where they store one
            (:class:`~mlx_stream.heads.HeadConfig`).
        draft_model: a :class:`~mlx_stream.drafters.draft_model.DraftModel` that drafts instead
            of the heads: its own tree (EAGLE-2's expansion,
            :data:`~mlx_stream.drafters.draft_model.DRAFT_TREE` by default;
            ``tree="dynamic:N[,W[,D]]"`` sets the node budget, width and depth), or a chain of
            ``num_draft_tokens``.
        num_draft_tokens: the draft model drafts a chain of this many tokens (mlx-lm's
            name), as :class:`~mlx_stream.drafters.draft_model.DraftModelDrafter` with width 1.
        draft_cache: the draft model's cache to draft from (kept across calls by a
            :class:`~mlx_stream.generate.PromptCache`); None: a fresh one.

    Raises:
        ValueError: a bad tree spec or ``prompt_lookup``, a dynamic tree without eagle
            heads, or ``num_draft_tokens`` without a draft model or below 1.
        TypeError: a ``draft_model`` that is not a :class:`~mlx_stream.drafters.draft_model.DraftModel`.
    """
    plan = plan_drafting(model, tree, prompt_lookup, store, sampled, draft_model, num_draft_tokens)
    return build_drafter(model, plan, draft_cache=draft_cache)
