"""Greedy tau by replay: the decode loop's drafting and acceptance, without its forwards.

Under greedy decoding the loop's output is the backbone's own greedy output (tested
token for token), so how many tokens each pass accepts depends only on that output
and on what the drafter proposes at each accepted position. :func:`replay_items`
makes the output and the final hidden states of all prompts at once with batched
generation (:func:`~mlx_stream.train.generation.generate_batch`), then walks each
sequence as :func:`mlx_stream.stream_generate` would: at every step the drafter (the
same object the loop uses: heads, tree, prompt lookup and its acceptance gate)
proposes a tree from the hidden state of the last accepted token, the longest
path that spells the next output tokens is accepted, the target's next token
follows it, and the drafter is told what was accepted. A step the loop queues
before the step before it is read back (:func:`mlx_stream.drafters.queued_tree`)
drafts the heads' static tree without a prompt-lookup chain here too.

Two approximations, both in near-ties only: batched generation can pick a different
greedy token than single-sequence decoding (fp32 round-off), and the heads read
float16 copies of the hidden states. Eagle heads also get the prompt's states (one
teacher-forced prefill of the prompts). Measured against the real loop in docs/heads.md
("Evaluating by replay").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_stream.drafters.base import AcceptanceObserver, propose
from mlx_stream.prompts import prompt_ids
from mlx_stream.speculation import dynamic_spec, is_budget, make_drafter, resolve_tree
from mlx_stream.steps import is_static_step, queued_drafter, queued_tree, queues_steps
from mlx_stream.tree import Tree

from .generation import generate_batch


def replay_sequence(
    drafter,
    prompt: Sequence[int],
    output: Sequence[int],
    hidden: np.ndarray,
    max_tokens: int,
    prompt_hidden: np.ndarray | None = None,
):
    """Replay one greedy decode.

    Args:
        drafter: a fresh drafter (:func:`mlx_stream.speculation.make_drafter`); its
            state (prompt lookup's gate) evolves as in the loop.
        prompt: prompt token ids.
        output: the greedy output (EOS included when it ended there), ``M`` tokens.
        hidden: ``(M, H)`` final hidden states; row i produced ``output[i]``.
        max_tokens: the generation budget (bounds the tree depth as in the loop).
        prompt_hidden: ``(len(prompt) - 1, H)`` final hidden states of the prompt's
            positions before the last (drafters that read every verified position,
            eagle heads; they get the states of the positions verified since their
            last call, as in the loop).

    Returns:
        ``(tokens, forward_passes)``: tokens made after the first (``M - 1``) and the
        decoding passes that made them.

    Raises:
        ValueError: a drafter that reads the KV cache or every verified position's
            state (msa, eagle heads).
    """
    if getattr(drafter, "capture", None) is not None:
        raise ValueError("replay needs heads that draft from final hidden states (not msa heads)")
    path = getattr(drafter, "reads_path", False)
    if path:
        if prompt_hidden is None:
            raise ValueError("eagle heads need the prompt's hidden states (prompt_hidden)")
        states = np.concatenate([prompt_hidden, hidden])  # positions 0 .. len(prompt) + M - 2
    done = 0  # positions whose states the drafter has seen
    output = [int(t) for t in output]
    tokens = list(prompt) + output[:1]
    n, passes = 1, 0
    # the loop queues a step before the step before it is read back where it can
    # (queued_tree): such a step drafts the static tree and no prompt-lookup chain
    queues = queues_steps(drafter)
    queued = queued_drafter(drafter) if queues else None
    ahead: Tree | None = None  # the tree of a step queued while the one before was in flight
    while n < len(output):
        depth = max_tokens - n - 1
        if path:
            r = len(tokens) - 1
            h = mx.array(states[done:r], dtype=mx.float32)
            done = r
        else:
            h = mx.array(hidden[n - 1], dtype=mx.float32)
        if ahead is None:
            tree, drafts = propose(drafter, h, tokens, depth)
            drafts = drafts.tolist()
            static = queues and is_static_step(tree, queued, depth)
        else:  # queued: the static tree, drafted as the loop drafts it (no chain)
            tree, static = ahead, True
            drafts = propose(queued, h, tokens, tree.depth)[1].tolist() if tree.size > 1 else []
        # (nothing is queued behind the first step: the loop's first token waits for one graph)
        ahead = (
            queued_tree(drafter, queued, tokens, depth - tree.depth - 1, True) if static and passes else None
        )
        node_tokens = [tokens[-1], *drafts]
        ok = [True] + [False] * (tree.size - 1)
        best = 0
        for i in range(1, tree.size):
            d = int(tree.depths[i])
            ok[i] = (
                ok[int(tree.parents[i])] and n + d - 1 < len(output) and node_tokens[i] == output[n + d - 1]
            )
            if ok[i]:
                best = max(best, d)
        emitted = output[n : n + best + 1]
        if isinstance(drafter, AcceptanceObserver):
            drafter.observe(tree, node_tokens, emitted)
        tokens.extend(emitted)
        n += len(emitted)
        passes += 1
    return len(output) - 1, passes


def greedy_outputs(
    model,
    tokenizer,
    items: Sequence[dict],
    max_tokens: int = 128,
    batch_size: int = 32,
    prompt_states: bool = False,
    fuse_layers: Sequence[int] = (),
) -> list[tuple | None]:
    """The backbone's greedy outputs for ``items`` with what a replay reads, made once
    (batched) so that several heads and trees can be replayed over them.

    Args:
        items: ``{"prompt", ...}`` (through the chat template).
        prompt_states: also the prompt positions' final hidden states (eagle heads).
        fuse_layers: with ``prompt_states``, every state is the fused feature of eagle
            heads that read these layers' inputs too (:func:`fused_states`).

    Returns:
        Per item, in order: None when the prompt and ``max_tokens`` do not fit in the
        context window, else ``(prompt ids, output tokens, (M, H) float16 hidden states,
        (len(prompt) - 1, H) prompt states or None)``.
    """
    ctx = model.context_length
    prompts = [prompt_ids(tokenizer, it["prompt"]) for it in items]
    todo = [i for i, p in enumerate(prompts) if ctx is None or len(p) + max_tokens <= ctx]
    states: dict[int, np.ndarray] = {}
    if prompt_states and not fuse_layers:
        from .features import teacher_forced

        for k, h, _, _ in teacher_forced(model, [(prompts[i], 1) for i in todo]):
            states[todo[k]] = h
        for i in todo:  # a one-token prompt has no earlier position
            states.setdefault(i, np.zeros((0, model.args.hidden_size), np.float16))
    out: list[tuple | None] = [None] * len(items)
    eos = set(tokenizer.eos_token_ids)
    for k, g in generate_batch(
        model, [prompts[i] for i in todo], max_tokens, eos_ids=eos, keep_hidden=True, batch_size=batch_size
    ):
        i = todo[k]
        out[i] = (prompts[i], g.tokens, g.hidden, states.get(i))
    return fused_states(model, out, fuse_layers) if prompt_states and fuse_layers else out


def fused_states(model, outputs: Sequence[tuple | None], fuse_layers: Sequence[int]) -> list[tuple | None]:
    """:func:`greedy_outputs`' outputs with every state replaced by the fused feature of
    eagle heads reading ``fuse_layers`` (EAGLE-3): the final hidden state followed by the
    inputs of those layers, from one teacher-forced pass over prompt + output
    (:func:`~mlx_stream.train.eagle.layer_features`). The states become
    ``(M, (1 + n) H)`` and the prompt's ``(len(prompt) - 1, (1 + n) H)``."""
    from .eagle import layer_features

    todo = [i for i, o in enumerate(outputs) if o is not None]
    seqs = [list(outputs[i][0]) + list(outputs[i][1]) for i in todo]
    out = list(outputs)
    for k, feats in layer_features(model.backbone, seqs, fuse_layers):
        prompt, output = outputs[todo[k]][:2]
        p = len(prompt) - 1
        out[todo[k]] = (prompt, output, feats[p : p + len(output)], feats[:p])
    return out


def replay_outputs(
    model,
    items: Sequence[dict],
    outputs: Sequence[tuple | None],
    max_tokens: int = 128,
    tree=None,
    prompt_lookup: int | None = None,
    progress: Callable[[dict], None] | None = None,
    store=None,
) -> list[dict]:
    """Rows of :func:`mlx_stream.bench.decode_items` from :func:`greedy_outputs`, drafting
    with ``model``'s heads (``tree`` resolved once; ``"budget"`` and dynamic trees: a
    fresh drafter per prompt), ``prompt_lookup`` and ``store``
    (:func:`mlx_stream.speculation.make_drafter`; None: ``model.datastore``)."""
    shape = tree if is_budget(tree) or dynamic_spec(tree) is not None else resolve_tree(model, tree)
    rows = []
    for it, o in zip(items, outputs):
        row = {"group": it["group"], "category": it["category"], "tokens": 0.0, "forward_passes": 0}
        row["skipped"] = o is None
        if o is not None:
            made, passes = replay_sequence(
                make_drafter(model, shape, prompt_lookup, store), o[0], o[1], o[2], max_tokens, o[3]
            )
            row["tokens"], row["forward_passes"] = float(made), passes
        rows.append(row)
        if progress:
            progress(row)
    return rows


def replay_items(
    model,
    tokenizer,
    items: Sequence[dict],
    max_tokens: int = 128,
    tree=None,
    prompt_lookup: int | None = None,
    batch_size: int = 32,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Greedy tau of ``items`` by replay, as rows of :func:`mlx_stream.bench.decode_items`
    (``group``, ``category``, ``tokens``, ``forward_passes``, ``skipped``), in item order:
    :func:`greedy_outputs`, then :func:`replay_outputs`.

    Args:
        items: ``{"prompt", "group", "category"}`` (through the chat template).
        tree, prompt_lookup: as :func:`mlx_stream.stream_generate` (the tree is resolved once).
        batch_size: sequences generated together.
        progress: called with each row as it is replayed.
    """
    shape = tree if is_budget(tree) or dynamic_spec(tree) is not None else resolve_tree(model, tree)
    drafter = make_drafter(model, shape, prompt_lookup)
    outputs = greedy_outputs(
        model,
        tokenizer,
        items,
        max_tokens,
        batch_size,
        prompt_states=getattr(drafter, "reads_path", False),
        fuse_layers=getattr(drafter, "fuse_layers", ()),
    )
    return replay_outputs(model, items, outputs, max_tokens, tree, prompt_lookup, progress)
