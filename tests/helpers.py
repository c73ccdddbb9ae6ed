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


FINE_TUNE_WORDS = (
    "the quick brown fox jumps over lazy dog speculative decoding drafts tokens verify tree".split()
)


def check_fine_tuning(target, init: str, tmp_path, run_cli) -> dict:
    """``mlx-stream train --init-heads INIT`` on a published drafter (an EAGLE-3 folder, or
    ``mtp``), as a user runs it: self-distilled completions of 40 short prompts of a domain, then

    - a run at a vanishing learning rate saves the drafter's own weights (it continues
      from them, it does not start afresh) with its options, vocabulary, depth and tree;
    - a run at a real learning rate raises the held-out top-1 of every checked depth and
      the drafts accepted, and decoding with the result stays greedy-identical to mlx-lm.

    Returns the second run's report."""
    import json

    from mlx.utils import tree_flatten

    from mlx_stream import load
    from mlx_stream.train.data import prompt_ids, read_jsonl
    from mlx_stream.train.eagle import evaluate_eagle, sequence_features

    # a domain: 40 requests of 5 kinds, so the held-out prompts' greedy texts are the domain's
    # (a tiny random target's text for an unseen prompt is not predictable two tokens ahead)
    rng = np.random.default_rng(0)
    kinds = [" ".join(rng.choice(FINE_TUNE_WORDS, 4)) for _ in range(5)]
    rows = [{"prompt": kinds[i % 5]} for i in range(40)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["train", "--model", str(target), "--data", str(data), "--init-heads", init, "--max-tokens", "48"]
    base += ["--no-tune"]
    before, tok = load(str(target), heads=init, dtype="float32")
    ref = dict(tree_flatten(before.heads.parameters()))

    r = run_cli(*base, "--out", str(tmp_path / "still"), "--lr", "1e-12", "--epochs", "1")
    assert r.returncode == 0, r.stderr
    still, _ = load(str(target), heads=str(tmp_path / "still" / "heads"), dtype="float32")
    got = dict(tree_flatten(still.heads.parameters()))
    assert got.keys() == ref.keys()
    for k, v in ref.items():  # (saved as float16)
        np.testing.assert_allclose(np.array(got[k]), np.array(v), atol=2e-3 * (1 + float(mx.abs(v).max())))
    for field in ("eagle3", "mtp", "fuse_layers", "num_heads", "draft_vocab_size", "tree", "layer_spec"):
        assert getattr(still.heads.config, field) == getattr(before.heads.config, field), field

    out = tmp_path / "tuned"
    r = run_cli(*base, "--out", str(out), "--lr", "3e-3", "--epochs", "4", "--warmup", "5")
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["architecture"] == "eagle" and report["init_heads"] == init
    after, _ = load(str(target), heads=str(out / "heads"), dtype="float32")
    valid_rows = read_jsonl(out / "data" / "valid.jsonl")
    valid = sequence_features(before, tok, valid_rows, fuse_layers=before.heads.config.fuse_layers)
    top_before = evaluate_eagle(before, before.heads, valid, 3)[0]
    top_after = evaluate_eagle(after, after.heads, valid, 3)[0]
    print(f"\n{init}: held-out top-1 per depth before {top_before}, after {top_after}")
    assert all(a > b + 0.05 for a, b in zip(top_after, top_before)), (top_before, top_after)
    accepted = {"before": 0, "after": 0}
    for row in valid_rows[:2]:
        ids = prompt_ids(tok, row["prompt"])  # (the chat template, as training saw the prompts)
        want = mlx_lm_greedy(before.backbone, tok, ids, 48)
        for name, m in (("before", before), ("after", after)):
            tokens, rs = ours(m, tok, ids, 48, adaptive=False, prompt_lookup=0)
            assert_greedy_identical(m, ids, tokens, want)
            accepted[name] += sum(r.accepted for r in rs)
    print(f"accepted drafts over 2 held-out prompts x 48 tokens: {accepted}")
    assert accepted["after"] > accepted["before"], accepted
    return report


def check_backlog(model, tok, make_drafter) -> None:
    """A drafter that reads every verified position (``reads_path``): a step drafted
    without it (``max_depth=0``) runs nothing, and its positions enter the drafter's
    cache with the next drafted step's, which then drafts what a drafter that read them
    at once drafts."""
    from mlx_stream.cache import make_tree_cache

    ids = tok.encode("The quick brown fox jumps over the lazy dog again")
    aux = list(model.heads.config.fuse_layers)
    h, mids = model.family.prefill_hidden(model.backbone, mx.array(ids), make_tree_cache(model.backbone), aux)
    feats = mx.concatenate([h, mids], axis=-1) if aux else h
    lazy, eager = make_drafter(), make_drafter()
    r = 5
    for d in (lazy, eager):
        d.draft(feats[:r], ids[: r + 1])
    before = lazy.draft(feats[r : r + 1], ids[: r + 2], max_depth=0)
    assert before.size == 0 and lazy._backlog.size == 1  # recorded, not run
    eager.draft(feats[r : r + 1], ids[: r + 2])
    for end in (r + 3, r + 4):  # two positions verified, then one
        start = r + 1 if end == r + 3 else r + 3
        a = lazy.draft(feats[start:end], ids[: end + 1])
        b = eager.draft(feats[start:end], ids[: end + 1])
        assert a.tolist() == b.tolist() and a.size > 0, (a.tolist(), b.tolist())
        assert lazy._backlog.size == 0
