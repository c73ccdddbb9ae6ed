"""Test helpers: greedy references from plain mlx-lm and the identity check."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream import stream_generate


def mlx_lm_greedy(model, tokenizer, ids, max_tokens, logits_processors=None, logprobs=None):
    """Plain mlx-lm greedy output (token ids; EOS not included), same model object.
    With a ``logprobs`` list, each token's log-probability (mlx-lm's) is appended to it."""
    out = []
    for r in mlx_lm.stream_generate(
        model, tokenizer, mx.array(ids), max_tokens=max_tokens, logits_processors=logits_processors
    ):
        if r.finish_reason == "stop" and r.token in tokenizer.eos_token_ids:
            break
        out.append(r.token)
        if logprobs is not None:
            logprobs.append(float(r.logprobs[r.token]))
    return out


class SelfDrafter:
    """Drafts the target's own top-k tokens (unprocessed logits, full forward per
    context), so drafts are accepted often and every verification branch runs;
    memoised by context, so repeated sampling from one prompt stays fast."""

    capture = None

    def __init__(self, model, tree):
        self.model, self.tree, self.memo = model, tree, {}

    def draft(self, hidden, tokens, mid=None, cache=None):
        t, out = self.tree, [int(tokens[-1])] + [0] * (self.tree.size - 1)
        for i in range(1, t.size):
            ctx = tuple(tokens) + tuple(out[j] for j in t.paths[int(t.parents[i])])
            if ctx not in self.memo:
                logits = self.model.backbone(mx.array(ctx)[None])[0, -1]
                self.memo[ctx] = np.argsort(-np.array(logits, dtype=np.float64), kind="stable")[:8]
            out[i] = int(self.memo[ctx][int(t.ranks[i])])
        return mx.array(out[1:], dtype=mx.int32)


def ours(model, tokenizer, ids, max_tokens, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, **kw):
        tokens.extend(r.tokens)
        responses.append(r)
    return tokens, responses


def top2_gap(model, ids):
    """The gap between the two largest logits after ``ids`` (sequential forward)."""
    cache = make_prompt_cache(model.backbone)
    logits = np.array(model.backbone(mx.array(ids)[None], cache=cache)[0, -1], dtype=np.float64)
    a, b = np.sort(logits)[-2:]
    return float(b - a)


def assert_greedy_identical(model, prompt_ids, got, ref, tol=1e-4):
    """Token-for-token equality; a first mismatch is excused only at a near-tie
    (top-2 logit gap below ``tol``), after which the sequences may diverge."""
    n = min(len(got), len(ref))
    for i in range(n):
        if got[i] != ref[i]:
            gap = top2_gap(model, list(prompt_ids) + ref[:i])
            assert gap < tol, f"mismatch at token {i}: {got[i]} vs mlx-lm {ref[i]}, top-2 gap {gap:.2e}"
            warnings.warn(
                f"near-tie exemption at token {i} (top-2 gap {gap:.2e})", stacklevel=2
            )  # shown in the summary
            return "tie"
    assert len(got) == len(ref), f"lengths differ: {len(got)} vs mlx-lm {len(ref)}"
    return "equal"


def train_on_ranks(model_dir: str, feats_dir: str, out: str, cfg: dict, draft_ids: list[int]) -> None:
    """One rank of a data-parallel :func:`train_heads` run (started by
    ``mlx_stream.distributed.launch_local``): rank 0 saves the float32 heads to
    ``out/heads.f32.safetensors``."""
    from mlx.utils import tree_flatten

    from mlx_stream import load
    from mlx_stream.distributed import connect
    from mlx_stream.heads import new_heads
    from mlx_stream.train import TrainConfig, load_features, train_heads

    ranks = connect(timeout_s=60)
    model, tok = load(model_dir, dtype="float32")
    heads = new_heads(model.backbone, tok, cfg["num_heads"], draft_ids=mx.array(draft_ids))
    train_heads(model, heads, load_features(feats_dir), out, TrainConfig(**cfg), progress=False, ranks=ranks)
    if ranks.is_main:
        mx.save_safetensors(f"{out}/heads.f32.safetensors", dict(tree_flatten(heads.parameters())))


def collectives_on_ranks(folder: str, out: str) -> None:
    """One rank of the collectives test: gather, broadcast and a folder copied from rank 1."""
    import json
    from pathlib import Path

    from mlx_stream.distributed import connect

    ranks = connect(timeout_s=60)
    got = {
        "gather": ranks.gather({"rank": ranks.rank, "text": "é" * (ranks.rank + 1)}),
        "broadcast": ranks.broadcast_object(f"from {ranks.rank}", root=1),
        "sum": np.array(ranks.sum(mx.array([ranks.rank + 1.0]))).tolist(),
        "local_size": ranks.local_size,
    }
    src = Path(folder) / f"rank{ranks.rank}"
    if ranks.rank == 1:  # rank 1 wrote a folder; rank 0 (another "machine") wants a copy
        src.mkdir(parents=True)
        (src / "a.bin").write_bytes(bytes(range(256)) * 1000)
        (src / "empty").write_bytes(b"")
    dst = Path(folder) / "rank1"
    ranks.barrier()
    ranks.share_folder(src if ranks.rank == 1 else dst.with_name("copy"), owner=1, want=ranks.rank == 0)
    (Path(out) / f"{ranks.rank}.json").write_text(json.dumps(got))
