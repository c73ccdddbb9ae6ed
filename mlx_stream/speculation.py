"""What a model drafts with, decided in one place: the draft tree from a spec
(:func:`resolve_tree`) and the drafter from a tree and the prompt-lookup budget
(:func:`make_drafter`)."""

from __future__ import annotations

from collections.abc import Sequence

from .defaults import AUTO_TREE, PROMPT_LOOKUP
from .drafters import Drafter, EagleDrafter, HeadsDrafter, LookupDrafter, NoDrafter
from .tree import Tree, no_drafts, parse_tree

TreeSpec = str | Sequence[Sequence[int]] | Tree | None


def is_auto(spec: TreeSpec) -> bool:
    """Whether ``spec`` asks for the tree measured fastest on this device."""
    return isinstance(spec, str) and spec.strip() == AUTO_TREE


def check_tree_spec(spec: TreeSpec) -> None:
    """Check a tree spec's syntax before any model is loaded (its depth is checked
    against the heads by :func:`resolve_tree`).

    Raises:
        ValueError: a malformed spec (see :func:`~mlx_stream.tree.parse_tree`).
    """
    if spec is not None and not is_auto(spec):
        parse_tree(spec, 1 << 10)


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
            Without heads, ``None`` is the root-only tree and other specs are not
            limited in depth (a custom drafter fills them).

    Raises:
        ValueError: a malformed spec, a tree deeper than the loaded heads, or ``"auto"``
            without heads that carry candidate trees.
    """
    heads = model.heads
    if is_auto(spec):
        from .autotree import auto_tree

        return auto_tree(model)[0]
    if heads is None:
        return no_drafts() if spec is None else parse_tree(spec, 1 << 10)
    if spec is None and heads.config.tree:
        spec = heads.config.tree
    return parse_tree(spec, heads.num_heads)


def make_drafter(model, tree: TreeSpec = None, prompt_lookup: int | None = None, store=None) -> Drafter:
    """The drafter for ``model``: its stream heads filling ``tree`` (or nothing without
    heads), with prompt lookup's chain beside them.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel`.
        tree: a tree spec (:func:`resolve_tree`); ignored without heads.
        prompt_lookup: the most tokens copied from the context per step
            (:class:`~mlx_stream.drafters.LookupDrafter`); 0 turns it off; ``None``:
            :data:`PROMPT_LOOKUP` with heads, 0 without.
        store: a :class:`~mlx_stream.datastore.Datastore` whose chains stand in where
            the context has no match (only with prompt lookup on).

    Raises:
        ValueError: a bad tree spec or ``prompt_lookup``.
    """
    check_prompt_lookup(prompt_lookup)
    if model.heads is None:
        drafter = NoDrafter()
    elif model.heads.autoregressive:
        drafter = EagleDrafter(model, resolve_tree(model, tree))
    else:
        drafter = HeadsDrafter(model, resolve_tree(model, tree))
    if prompt_lookup is None:
        prompt_lookup = PROMPT_LOOKUP if model.heads is not None else 0
    return LookupDrafter(drafter, prompt_lookup, store=store) if prompt_lookup else drafter
