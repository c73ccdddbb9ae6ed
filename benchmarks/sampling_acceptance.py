"""How often a sampled draft is accepted, under each verification rule: a replay.

Sampled outputs of the default model (Spec-Bench prompts, plain decoding, temperature T)
are replayed teacher-forced: at every position the target's processed distribution p and
the stream heads' distribution q for the same token (head j from the hidden state j
positions back, on the true path) give, per depth, the probability that the depth's draft
is accepted:

* ``gumbel-topk``: the loop's rule: drafts are the top-k of ``log q / T + g``, accepted
  when the target's Gumbel-max draw ``argmax(log p + g)`` is among them (same noise g);
  Monte Carlo over g.
* ``onehot-topk``: deterministic top-k of q, verified by SpecInfer's rule with one-hot q:
  the target's mass on them, ``sum p(topk q)``.
* ``sample-k``: k drafts drawn i.i.d. from q, SpecInfer's multi-candidate rule (accept with
  min(1, p/q), residual max(0, p - q)): ``1 - prod(1 - sum min(r_i, q))``, exactly.

    python benchmarks/sampling_acceptance.py --temp 0.7 --per-group 2 [--out runs/acc.json]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

from mlx_stream import load
from mlx_stream.prompts import load_spec_bench, prompt_ids


def sample_outputs(model, tok, items, temp: float, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    out = []
    for i, it in enumerate(items):
        mx.random.seed(i)
        ids = prompt_ids(tok, it["prompt"])
        gen = [
            r.token
            for r in stream_generate(
                model.backbone, tok, ids, max_tokens=max_tokens, sampler=make_sampler(temp=temp)
            )
        ]
        out.append((ids, gen))
    return out


def sum_min(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return np.minimum(p, q).sum(-1)


def rates(p: np.ndarray, logq: np.ndarray, temp: float, draws: int, rng) -> dict[str, np.ndarray]:
    """Per-row acceptance of one depth's drafts. p: (n, V) target; logq: (n, V) head logits
    (-inf outside the draft vocabulary)."""
    q = np.exp(logq / temp - np.logaddexp.reduce(logq / temp, axis=-1, keepdims=True))
    res: dict[str, np.ndarray] = {}
    order = np.argpartition(-q, 3, axis=-1)[:, :4]
    order = np.take_along_axis(order, np.argsort(-np.take_along_axis(q, order, -1), -1), -1)
    mass = np.take_along_axis(p, order, axis=-1)
    for k in (1, 2, 4):
        res[f"onehot-top{k}"] = mass[:, :k].sum(-1)
    a = sum_min(p, q)
    res["sample-1"] = a
    r = np.maximum(p - q, 0)
    r = r / np.maximum(r.sum(-1, keepdims=True), 1e-30)
    a2 = sum_min(r, q)
    res["sample-2"] = a + (1 - a) * a2
    logp = np.log(np.maximum(p, 1e-38))
    hits = {k: np.zeros(len(p)) for k in (1, 2, 4)}
    for _ in range(draws):
        g = rng.gumbel(size=p.shape).astype(np.float32)
        x = np.argmax(logp + g, axis=-1)
        top = np.argpartition(-(logq / temp + g), 3, axis=-1)[:, :4]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(logq / temp + g, top, -1), -1), -1)
        for k in hits:
            hits[k] += (top[:, :k] == x[:, None]).any(-1)
    for k in hits:
        res[f"gumbel-top{k}"] = hits[k] / draws
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draws", type=int, default=16, help="Gumbel draws per position")
    ap.add_argument("--depths", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, tok = load("smollm2-135m-instruct", heads="default", dtype="float32")
    heads = model.heads
    ids_v = heads.draft_ids if heads.config.draft_vocab_size else None
    rows = None
    if ids_v is not None:
        from mlx_stream.heads import output_weight

        rows = output_weight(model.backbone)[ids_v]
    items = load_spec_bench(per_group=args.per_group)
    seqs = sample_outputs(model, tok, items, args.temp, args.max_tokens)
    rng = np.random.default_rng(0)
    K = min(args.depths, heads.num_heads)
    acc: dict[int, dict[str, list]] = {d: {} for d in range(1, K + 1)}
    for ids, gen in seqs:
        full = mx.array(ids + gen, dtype=mx.int32)
        hidden, _ = model.family.prefill_hidden(model.backbone, full, None)
        logits = model.project(hidden).astype(mx.float32)  # (L, V): row t -> token t+1
        L, P = full.shape[0], len(ids)
        # positions t whose path tokens t+1 .. t+num_heads all exist
        ts = np.arange(P - 1, L - heads.num_heads)
        if len(ts) == 0:
            continue
        tsa = mx.array(ts)
        path = mx.stack([full[tsa + j] for j in range(1, heads.num_heads + 1)], axis=1)
        emb = model.embed(path) if heads.conditioned else None
        hq = model.project(heads(hidden[tsa], emb), rows).astype(mx.float32)  # (K_all, n, V')
        vocab = logits.shape[-1]
        for d in range(1, K + 1):
            # head d at t drafts token t+1+d; the target's distribution for it is row t+d
            p = np.array(mx.softmax(logits[tsa + d] / args.temp, axis=-1))
            lq = np.full((len(ts), vocab), -np.inf, dtype=np.float32)
            hq_d = np.array(hq[d - 1])
            if ids_v is None:
                lq[:] = hq_d
            else:
                lq[:, np.array(ids_v)] = hq_d
            for name, v in rates(p, lq, args.temp, args.draws, rng).items():
                acc[d].setdefault(name, []).extend(v.tolist())
    table = {d: {name: float(np.mean(v)) for name, v in acc[d].items()} for d in acc}
    n = len(next(iter(acc[1].values())))
    print(f"T = {args.temp}, {len(seqs)} prompts, {n} positions")
    names = list(table[1])
    print("depth  " + "  ".join(f"{x:>13}" for x in names))
    for d in table:
        print(f"{d:5d}  " + "  ".join(f"{table[d][x]:13.3f}" for x in names))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"temp": args.temp, "prompts": len(seqs), "positions": n, "rates": table}, f, indent=1)


if __name__ == "__main__":
    main()
