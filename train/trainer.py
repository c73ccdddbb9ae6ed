"""Training stream heads on a feature cache: AdamW, warm-up + cosine, gradient
accumulation, atomic checkpoints, resume, validation and a report."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_stream.distributed import Ranks
from mlx_stream.files import staged_folder

from .config import TrainConfig
from .features import FeatureCache
from .loss import draft_vocab_lut, head_weights, stream_logits, stream_loss


def implied_tau(ranks: np.ndarray, choices) -> float:
    """Mean tokens per forward pass that a tree implies, from the rank of each true
    token in its head's top-k.

    Args:
        ranks: ``(P, K)`` int, the rank of target t+1+j in head j's logits at each
            position (-1 = outside the ranks considered or no target).
        choices: the tree's paths of ranks.

    Returns:
        1 + the mean, over positions, of the longest prefix ``(r_1..r_d)`` that is a
        path of the tree (greedy tree verification accepts exactly that prefix).
    """
    paths = {tuple(c) for c in choices}
    total = 0
    for row in ranks:
        d = 0
        while d < len(row) and row[d] >= 0 and tuple(int(r) for r in row[: d + 1]) in paths:
            d += 1
        total += d
    return 1.0 + total / max(len(ranks), 1)


def loss_streams(num_heads: int, threads: int | None = None) -> list | None:
    """The MLX streams a training step spreads the heads' loss over: on a CPU one per
    core (``threads``: this process's share of them; default all) up to one per head
    (MLX runs each CPU stream on its own thread, and the softmax over the draft
    vocabulary runs on one thread per op); None elsewhere."""
    if mx.default_device() != mx.cpu:
        return None
    n = min(num_heads, threads or os.cpu_count() or 1)
    return [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in range(n - 1)] if n > 1 else None


def _draft_rows(model, heads):
    from mlx_stream.heads import output_weight

    return output_weight(model.backbone)[heads.draft_ids] if heads.config.draft_vocab_size else None


def head_ranks(model, heads, feats: FeatureCache, batch_size: int = 512, max_rank: int = 10) -> np.ndarray:
    """``(P, K)`` int: the rank of the true token t+1+j in head j's logits at every
    position of ``feats`` (hydra heads teacher-forced along the true path); -1 when
    the rank is ``max_rank`` or more, the target is missing, or it lies outside a
    reduced draft vocabulary."""
    K = heads.num_heads
    rows, lut = _draft_rows(model, heads), draft_vocab_lut(heads, model.args.vocab_size)
    all_ranks = []
    for i in range(0, len(feats), batch_size):
        h = mx.array(np.asarray(feats.hidden[i : i + batch_size]))
        full = mx.array(np.asarray(feats.targets[i : i + batch_size, : K + 1]))
        tg = full[:, 1:].T  # (K, B)
        if lut is not None:
            tg = mx.where(tg >= 0, lut[mx.maximum(tg, 0)], -1)
        logits = stream_logits(model, heads, h, rows, path=full[:, :K])  # (K, B, V)
        true = mx.take_along_axis(logits, mx.maximum(tg, 0)[..., None], axis=-1)
        rank = (logits > true).sum(axis=-1)  # (K, B): how many tokens beat the target
        rank = mx.where((tg >= 0) & (rank < max_rank), rank, -1)
        all_ranks.append(np.array(rank.T))
    return np.concatenate(all_ranks) if all_ranks else np.zeros((0, K), dtype=np.int32)


def evaluate(
    model, heads, feats: FeatureCache, batch_size: int = 512, max_rank: int = 10, trees: dict | None = None
) -> dict:
    """Held-out per-head top-1/top-5 accuracy and the tau implied for each tree.
    Targets outside a reduced draft vocabulary count as misses.

    Returns ``{"top1": [...], "top5": [...], "positions": P, "tau": {name: value}}``.
    """
    K = heads.num_heads
    ranks = head_ranks(model, heads, feats, batch_size, max_rank)
    valid = np.asarray(feats.targets[:, 1 : K + 1]) >= 0
    n = np.maximum(valid.sum(axis=0), 1)
    out = {
        "positions": int(len(feats)),
        "top1": [float(((ranks[:, j] == 0) & valid[:, j]).sum() / n[j]) for j in range(K)],
        "top5": [
            float(((ranks[:, j] >= 0) & (ranks[:, j] < 5) & valid[:, j]).sum() / n[j]) for j in range(K)
        ],
    }
    out["tau"] = {name: implied_tau(ranks, choices) for name, choices in (trees or {}).items()}
    return out


def tune_tree(
    model, heads, valid: FeatureCache, max_nodes: int = 15, ranks: np.ndarray | None = None
) -> dict:
    """Choose the draft tree for ``heads`` on this machine: for each size N, the tree of
    N drafted nodes with the highest held-out tau (:func:`mlx_stream.tree.tree_from_ranks`),
    scored by tau / cost, where cost is the measured time of an (N + 1)-token forward
    plus drafting that tree with these heads, relative to a 1-token forward (the
    plain decoding step; :func:`mlx_stream.speculation.score_trees`). Sets
    ``heads.config.tree`` to the best and ``heads.config.tree_taus`` to every size's
    tree and tau (the candidates of ``tree="auto"`` on other devices).

    Returns ``{"best": N, "sizes": {N: {"tree", "tau", "cost", "draft_ms", "speedup_bound"}}}``
    (``speedup_bound`` = tau / cost: the speedup if the loop had no other overhead).
    """
    from mlx_stream.cost import measure_costs
    from mlx_stream.model import SpeculativeModel
    from mlx_stream.speculation import score_trees
    from mlx_stream.tree import format_tree, tree_from_ranks

    if ranks is None:  # ranks of heads that read one position (eagle heads bring their own)
        ranks = head_ranks(model, heads, valid)
    best_trees = [tree_from_ranks(ranks, n) for n in range(max_nodes + 1)]
    costs = measure_costs(SpeculativeModel(model.backbone, heads), [t for t, _ in best_trees])
    scored = score_trees(best_trees, costs)
    sizes = {n: {k: v for k, v in row.items() if k != "nodes"} for n, row in enumerate(scored["sizes"])}
    best = scored["best"]
    heads.config.tree = sizes[best]["tree"]
    heads.config.tree_taus = {format_tree(t): tau for t, tau in best_trees[1:]}
    return {"best": best, "sizes": sizes}


def _schedule(cfg: TrainConfig, total: int):
    warm = max(min(cfg.warmup, total - 1), 1)
    return optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr / warm, cfg.lr, warm),
            optim.cosine_decay(cfg.lr, max(total - warm, 1)),
        ],
        [warm],
    )


def _save_checkpoint(path: Path, heads, opt, state: dict) -> None:
    with staged_folder(path, replace=True) as tmp:
        mx.save_safetensors(str(tmp / "heads.safetensors"), dict(tree_flatten(heads.parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
        (tmp / "state.json").write_text(json.dumps(state, indent=2))


def _load_checkpoint(path: Path, heads, opt) -> dict:
    try:
        state = json.loads((path / "state.json").read_text())
        heads.load_weights(list(mx.load(str(path / "heads.safetensors")).items()), strict=True)
        opt.state = tree_unflatten(list(mx.load(str(path / "optimizer.safetensors")).items()))
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"{path}: checkpoint unreadable ({e}); delete it to start over") from e
    return state


def train_heads(
    model,
    heads,
    train: FeatureCache,
    out_dir: str | Path,
    cfg: TrainConfig,
    valid: FeatureCache | None = None,
    resume: bool = False,
    progress: bool = True,
    trees: dict | None = None,
    stop_after: int | None = None,
    ranks: Ranks | None = None,
) -> dict | None:
    """Train ``heads`` (in place) on ``train``; the backbone is never updated.

    Data-parallel over ``ranks`` (:mod:`mlx_stream.distributed`; default one rank): every
    rank holds the same features and draws the same global batches; rank r computes
    the loss of rows r, r + size, ... of each, normalised by the whole batch's label
    counts, and the gradients are summed with ``all_sum``, so the update is the
    one-rank update whatever the rank count (up to float summation order). Rank 0
    alone writes the checkpoint, the heads and the report; on ``resume`` it reads
    the checkpoint and the other ranks receive its state. The other ranks return None.

    Writes ``out_dir/checkpoint`` every ``cfg.checkpoint_every`` optimizer steps (an
    atomic folder swap) and, at the end, ``out_dir/heads`` (the heads folder) and
    ``out_dir/report.json``. With ``resume=True`` the run continues from the
    checkpoint with the same batch order, so it ends where an uninterrupted run ends.
    ``stop_after`` ends the run after that many optimizer steps in this call, leaving
    only the checkpoint (as if it were killed); it returns ``None`` then.

    Returns:
        The report: config, steps, wall time, tokens/s, peak memory, training loss,
        held-out accuracy and implied tau.
    """
    from mlx_stream.heads import save_heads

    out_dir = Path(out_dir)
    P = len(train)
    per_epoch = max(P // cfg.batch_size, 1)
    total_micro = max(int(math.ceil(cfg.epochs * per_epoch)), cfg.grad_accum)
    total_steps = total_micro // cfg.grad_accum
    opt = optim.AdamW(learning_rate=_schedule(cfg, total_steps), weight_decay=cfg.weight_decay)
    weights = head_weights(heads.num_heads, cfg.head_decay)
    model.backbone.freeze()
    ranks = ranks or Ranks()
    if cfg.batch_size < ranks.size:
        raise ValueError(f"batch size {cfg.batch_size} is below the {ranks.size} ranks: each needs rows")

    rows, lut = _draft_rows(model, heads), draft_vocab_lut(heads, model.args.vocab_size)

    streams = loss_streams(heads.num_heads, ranks.threads())

    def loss_fn(h, t, path, teacher, soft, counts):
        return stream_loss(
            model,
            heads,
            h,
            t,
            weights,
            rows,
            path=path,
            teacher=teacher,
            kl_weight=cfg.kl_weight,
            soft=soft,
            streams=streams,
            counts=counts,
        )

    loss_and_grad = nn.value_and_grad(heads, loss_fn)
    ckpt = out_dir / "checkpoint"
    step, losses = 0, []
    if resume and ckpt.exists() and ranks.is_main:
        st = _load_checkpoint(ckpt, heads, opt)
        step, losses = st["step"], st["losses"]
    opt.init(heads.trainable_parameters()) if not opt.state else None
    if ranks.size > 1:  # every rank starts from rank 0's heads, optimizer state and step
        step, losses = ranks.broadcast_object([step, losses])
        heads.update(ranks.broadcast_tree(heads.trainable_parameters()))
        opt.state = ranks.broadcast_tree(opt.state)
        mx.eval(heads.parameters(), opt.state)

    @functools.lru_cache(maxsize=1)
    def order(epoch: int) -> np.ndarray:  # one seeded permutation per epoch
        return np.random.default_rng(cfg.seed + epoch).permutation(P)

    def batch(micro: int):
        epoch, k = divmod(micro, per_epoch)
        perm = order(epoch)
        idx = np.sort(perm[k * cfg.batch_size : (k + 1) * cfg.batch_size])
        tg = path = mx.array(np.asarray(train.targets[idx, : heads.num_heads + 1]))
        if lut is not None:  # labels as draft-vocabulary indices, -1 (ignored) outside it
            tg = mx.where(tg >= 0, lut[mx.maximum(tg, 0)], -1)
        counts = None
        if ranks.size > 1:  # this rank's rows of the batch; the loss divides by the whole batch's counts
            counts = (tg[:, 1:] >= 0).sum(axis=0)
            mine = mx.array(np.arange(ranks.rank, len(idx), ranks.size))
            idx, tg, path = idx[ranks.rank :: ranks.size], tg[mine], path[mine]
        teacher = soft = None
        if cfg.kl_weight > 0:  # rows t+j: the next rows of the same sequence (clipped rows are masked out)
            nxt = np.minimum(idx[:, None] + np.arange(1, heads.num_heads + 1)[None, :], P - 1).reshape(-1)
            if train.top_k:  # the stored top-k log-probabilities
                lp = mx.array(np.asarray(train.top_logprobs[nxt]).reshape(len(idx), heads.num_heads, -1))
                ids = mx.array(np.asarray(train.top_ids[nxt]).reshape(len(idx), heads.num_heads, -1))
                soft = (lp, ids if lut is None else lut[ids])
            else:  # the backbone's distribution recomputed from the hidden states h_{t+j}
                teacher = mx.array(np.asarray(train.hidden[nxt]).reshape(len(idx), heads.num_heads, -1))
        return mx.array(np.asarray(train.hidden[idx])), tg, path[:, : heads.num_heads], teacher, soft, counts

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        disable=not progress or not ranks.is_main,
    )
    tic, start_step = time.perf_counter(), step
    correct = np.zeros((heads.num_heads, 2))
    with bar:
        task = bar.add_task("train", total=total_steps, completed=step, info="")
        while step < total_steps:
            grads_sum, loss_sum = None, 0.0
            for a in range(cfg.grad_accum):
                (loss, corr), grads = loss_and_grad(*batch(step * cfg.grad_accum + a))
                if ranks.size > 1:  # the slices' gradients sum to the whole batch's
                    grads, loss, corr = tree_map(ranks.sum, grads), ranks.sum(loss), ranks.sum(corr)
                grads_sum = grads if grads_sum is None else _tree_add(grads_sum, grads)
                loss_sum = loss_sum + loss
                correct += np.array(corr)
            if cfg.grad_accum > 1:
                grads_sum = _tree_scale(grads_sum, 1.0 / cfg.grad_accum)
            opt.update(heads, grads_sum)
            mx.eval(heads.parameters(), opt.state, loss_sum)
            step += 1
            losses.append(float(loss_sum) / cfg.grad_accum)
            done = step - start_step
            tps = done * cfg.grad_accum * cfg.batch_size / (time.perf_counter() - tic)
            acc = " ".join(f"{c / max(n, 1):.2f}" for c, n in correct)
            info = f"loss {losses[-1]:.3f}  top-1 {acc}  {tps:.0f} tok/s"
            bar.update(task, completed=step, info=info)
            if (
                progress
                and ranks.is_main
                and not bar.console.is_terminal
                and (step % 25 == 0 or step == total_steps)
            ):
                eta = (total_steps - step) * (time.perf_counter() - tic) / done
                print(f"[train] step {step}/{total_steps}  {info}  eta {eta / 60:.1f} min", flush=True)
            if step % 50 == 0:
                correct[:] = 0
            if (
                ranks.is_main
                and cfg.checkpoint_every
                and step % cfg.checkpoint_every == 0
                and step < total_steps
            ):
                _save_checkpoint(ckpt, heads, opt, {"step": step, "losses": losses, "config": asdict(cfg)})
            if stop_after is not None and step - start_step >= stop_after and step < total_steps:
                return None
    wall = time.perf_counter() - tic
    heads.config.trained_positions += total_micro * cfg.batch_size
    if not ranks.is_main:
        return None
    save_heads(heads, out_dir / "heads", dtype=mx.float16)  # float16 on disk: half the size
    report = {
        "config": asdict(cfg),
        "steps": total_steps,
        "train_positions": P,
        "wall_s": wall,
        "tokens_per_s": (total_steps - start_step) * cfg.grad_accum * cfg.batch_size / max(wall, 1e-9),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "first_loss": float(np.mean(losses[:5])) if losses else None,
        "final_loss": float(np.mean(losses[-20:])) if losses else None,
        "head_params": sum(v.size for _, v in tree_flatten(heads.trainable_parameters())),
        "draft_vocab_size": heads.config.draft_vocab_size,
        "backbone_params": sum(v.size for _, v in tree_flatten(model.backbone.parameters())),
        "ranks": ranks.size,
    }
    if valid is not None and len(valid):
        report["valid"] = evaluate(model, heads, valid, trees=trees)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(ckpt, ignore_errors=True)
    return report


def _tree_add(a, b):
    from mlx.utils import tree_map

    return tree_map(lambda x, y: x + y, a, b)


def _tree_scale(a, s: float):
    from mlx.utils import tree_map

    return tree_map(lambda x: x * s, a)
