"""What a model drafts with, decided in one place: the draft tree from a spec
(:func:`resolve_tree`) and the drafter from a tree and the prompt-lookup budget
(:func:`make_drafter`)."""

from __future__ import annotations

from collections.abc import Sequence

from .defaults import AUTO_TREE, BUDGET_TREE, PROMPT_LOOKUP
from .drafters import Drafter, DynamicTreeDrafter, EagleDrafter, HeadsDrafter, LookupDrafter, NoDrafter
from .tree import Tree, no_drafts, parse_tree

TreeSpec = str | Sequence[Sequence[int]] | Tree | None


def is_auto(spec: TreeSpec) -> bool:
    """Whether ``spec`` asks for the tree measured fastest on this device."""
    return isinstance(spec, str) and spec.strip() == AUTO_TREE


def is_budget(spec: TreeSpec) -> bool:
    """Whether ``spec`` asks for the tree budgeted per step across sources
    (:class:`~mlx_stream.budget.BudgetDrafter`)."""
    return isinstance(spec, str) and spec.strip() == BUDGET_TREE


def dynamic_spec(spec: TreeSpec) -> tuple[int, int] | None:
    """``(budget, width)`` of a dynamic-tree spec (``"dynamic:N"`` or ``"dynamic:N,W"``:
    EAGLE-2's budgeted dynamic tree of at most N nodes, W children per expanded node,
    default 4; eagle heads only), or ``None`` for any other spec. ``"dynamic:auto[,W]"``
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
        if len(nums) not in (1, 2) or nums[0] == 1 or nums[0] < 0 or (len(nums) == 2 and nums[1] < 1):
            raise ValueError
        if nums[0] == 0 and parts[0].strip() != "auto":
            raise ValueError
    except ValueError:
        raise ValueError(
            f"bad dynamic tree spec {spec!r}: use dynamic:N (N >= 2 nodes, root included), "
            "dynamic:N,W (W >= 1 children per expanded node) or dynamic:auto[,W]"
        ) from None
    return nums[0], nums[1] if len(nums) == 2 else 4


def check_tree_spec(spec: TreeSpec) -> None:
    """Check a tree spec's syntax before any model is loaded (its depth is checked
    against the heads by :func:`resolve_tree`).

    Raises:
        ValueError: a malformed spec (see :func:`~mlx_stream.tree.parse_tree` and
            :func:`dynamic_spec`).
    """
    if spec is not None and not is_auto(spec) and not is_budget(spec) and dynamic_spec(spec) is None:
        try:
            parse_tree(spec, 1 << 10)
        except ValueError as e:
            raise ValueError(f"{e}; or '{AUTO_TREE}', '{BUDGET_TREE}', 'dynamic:N[,W]'") from None


def check_prompt_lookup(prompt_lookup: int | None) -> None:
    """Raise ``ValueError`` unless ``prompt_lookup`` is ``None`` or an integer >= 0."""
    if prompt_lookup is not None and (
        isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) or prompt_lookup < 0
    ):
        raise ValueError(f"prompt_lookup must be an integer >= 0 (0: off) or None, got {prompt_lookup!r}")


def resolve_tree(model, spec: TreeSpec = None) -> Tree:
    """The draft tree a spec names for ``model``.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel`.
        spec: ``None``: the tree stored with the heads (``HeadConfig.tree``, chosen at
            training), else the default sparse tree; ``"auto"``: the heads' candidate
            with the best expected speed on this device (:func:`~mlx_stream.autotree.auto_tree`,
            measured once, then cached); a preset (``"sparse"``, ``"chain"``,
            ``"chain:K"``, ``"none"``), rank paths such as ``"0;1;0,0"``, a list of paths
            or a :class:`~mlx_stream.tree.Tree` (:func:`~mlx_stream.tree.parse_tree`).
            Dynamic trees (``"dynamic:N"``, :func:`dynamic_spec`) have no static shape
            and are refused here; :func:`make_drafter` builds them.
            Without heads, ``None`` is the root-only tree and other specs are not
            limited in depth (a custom drafter fills them).

    Raises:
        ValueError: a malformed spec, a tree deeper than the loaded heads, ``"auto"``
            without heads that carry candidate trees, or a dynamic tree.
    """
    heads = model.heads
    if spec is None and heads is not None and heads.config.tree:
        spec = heads.config.tree
    if dynamic_spec(spec) is not None or is_budget(spec):
        raise ValueError(
            f"{spec!r} is a dynamic tree (its shape changes every step): use it with make_drafter or "
            "stream_generate, not as a static tree"
        )
    if is_auto(spec):
        from .autotree import auto_tree

        return auto_tree(model)[0]
    if heads is None:
        return no_drafts() if spec is None else parse_tree(spec, 1 << 10)
    return parse_tree(spec, heads.num_heads)


def stored_tree(model, sampled: bool = False) -> str | None:
    """The tree spec ``model``'s heads store for greedy decoding (their config's ``tree``)
    or for sampling (``sampled_tree``, else ``tree``): what ``tree=None`` drafts; None
    without heads or without a stored tree (then the heads' default tree)."""
    if model.heads is None:
        return None
    cfg = model.heads.config
    return (cfg.sampled_tree if sampled and cfg.sampled_tree else cfg.tree) or None


def make_drafter(
    model, tree: TreeSpec = None, prompt_lookup: int | None = None, store=None, sampled: bool = False
) -> Drafter:
    """The drafter for ``model``: its stream heads filling ``tree`` (or nothing without
    heads), with prompt lookup's chain beside them.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel`.
        tree: a tree spec (:func:`resolve_tree`), ``"dynamic:N[,W]"`` for EAGLE-2's
            dynamic tree (:class:`~mlx_stream.drafters.DynamicTreeDrafter`, eagle heads
            only; ``"dynamic:auto[,W]"``: N is the size of the heads' candidate tree with
            the best tau / cost on this device, :func:`~mlx_stream.autotree.auto_tree`,
            and a plain step when no tree pays), or ``"budget"``: each step's tree
            budgeted across the heads' candidate trees, prompt lookup and the
            datastore by estimated acceptance and this device's measured costs
            (:class:`~mlx_stream.budget.BudgetDrafter`; the costs are measured once
            per device and cached); ignored without heads, except ``"budget"``.
        prompt_lookup: the most tokens copied from the context per step
            (:class:`~mlx_stream.drafters.LookupDrafter`); 0 turns it off; ``None``:
            :data:`PROMPT_LOOKUP` with heads, 0 without.
        store: a :class:`~mlx_stream.datastore.Datastore` (or
            :class:`~mlx_stream.datastore.DraftStore`) whose chains stand in where the
            context has no match (only with prompt lookup on); ``None``: the model's
            own (``model.datastore``: the heads' store and this machine's answers);
            ``False``: none.
        sampled: the drafts serve sampled decoding (temperature > 0): ``tree=None`` is
            then the heads' ``sampled_tree`` where they store one
            (:class:`~mlx_stream.heads.HeadConfig`).

    Raises:
        ValueError: a bad tree spec or ``prompt_lookup``, or a dynamic tree without eagle heads.
    """
    check_prompt_lookup(prompt_lookup)
    if store is None:
        store = getattr(model, "datastore", None)
    if is_budget(tree):
        return _budget_drafter(model, prompt_lookup, store or None)
    if tree is None:
        tree = stored_tree(model, sampled)
    dyn = dynamic_spec(tree) if model.heads is not None else None
    if dyn is not None:
        if not model.heads.autoregressive:
            raise ValueError(
                f"a dynamic tree ({tree!r}) needs eagle heads (an EAGLE-style draft layer); "
                f"these heads are {model.heads.config.architecture!r}: use a static tree"
            )
        budget = dyn[0]
        if budget == 0:  # the node budget whose best static tree pays most here (EAGLE-2's N from c(N))
            from .autotree import auto_tree

            budget = auto_tree(model)[0].size
        drafter = (
            DynamicTreeDrafter(model, budget, dyn[1]) if budget >= 2 else EagleDrafter(model, no_drafts())
        )
    elif model.heads is None:
        drafter = NoDrafter()
    elif model.heads.autoregressive:
        drafter = EagleDrafter(model, resolve_tree(model, tree))
    else:
        drafter = HeadsDrafter(model, resolve_tree(model, tree))
    if prompt_lookup is None:
        prompt_lookup = PROMPT_LOOKUP if model.heads is not None else 0
    return LookupDrafter(drafter, prompt_lookup, store=store or None) if prompt_lookup else drafter


def _budget_drafter(model, prompt_lookup: int | None, store):
    from .budget import BudgetDrafter, head_candidates, measure_costs

    heads = model.heads
    if heads is not None and heads.autoregressive:
        raise ValueError(
            "the budgeted tree ('budget') drafts from heads that read one hidden state; these are eagle "
            "heads: use a static tree or 'dynamic:N'"
        )
    if prompt_lookup is None:
        prompt_lookup = PROMPT_LOOKUP
    cands = [t for t, _ in head_candidates(heads)] if heads is not None else []
    base = HeadsDrafter(model, resolve_tree(model, None)) if heads is not None else NoDrafter()
    costs = measure_costs(model, cands)
    return BudgetDrafter(
        model, costs, base, num_draft=max(prompt_lookup, 1), store=store, chains=prompt_lookup > 0
    )
