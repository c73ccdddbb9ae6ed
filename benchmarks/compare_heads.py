"""Compare stream-head architectures on the same self-distilled sequences.

Trains residual (Medusa-1), hydra, multi-stream attention ("msa") and EAGLE-style
("eagle": a draft layer copied from the backbone's top layer; "eagle-random": the same
layer initialised randomly) heads on the
same training positions of a finished `mlx-stream train` run folder (its
data/train.jsonl and data/valid.jsonl), for the same number of epochs, and reports
per architecture: held-out top-1/top-5 per head, the tau implied by the best 5- and
15-node trees and by a chain, head parameters, training speed, and the time to
draft one tree at decode time.

    python benchmarks/compare_heads.py --run runs/smollm2-135m-instruct --sequences 300

(run with OpenBLAS preloaded, as `make` does). Prints a markdown table and writes
the numbers as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_stream.cost import draft_times
from mlx_stream.heads import load_heads, new_heads, save_heads
from mlx_stream.loader import load
from mlx_stream.prompts import read_jsonl
from mlx_stream.train.eagle import EagleSequence, evaluate_eagle, train_eagle
from mlx_stream.train.eagle import sequence_features as eagle_features
from mlx_stream.train.features import FeatureCache, targets_for
from mlx_stream.train.pipeline import choose_draft_vocab
from mlx_stream.train.streams import StreamSequence, sequence_features, stream_ranks, train_stream_heads
from mlx_stream.train.trainer import TrainConfig, head_ranks, train_heads, tune_tree
from mlx_stream.tree import format_tree, tree_from_ranks


def position_cache(seqs, finals, num_heads):
    hs = [f[max(s.start - 1, 0) : len(s.ids) - 1] for s, f in zip(seqs, finals)]
    ts = [targets_for(s.ids, s.start, num_heads) for s in seqs]
    return FeatureCache(np.concatenate(hs), np.concatenate(ts), {})


def advance(model, seqs, layer, n):
    """The sequences with ``mid`` moved from the input of ``layer`` to that of ``layer + n``
    (the frozen layers in between, causal)."""
    if n == 0:
        return seqs
    out = []
    for s in seqs:
        h = mx.array(s.mid.astype(np.float32))[None]
        for blk in model.backbone.model.layers[layer : layer + n]:
            h = blk(h, "causal", None)
        out.append(StreamSequence(s.ids, s.start, np.array(h[0].astype(mx.float16))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--run",
        default="runs/smollm2-135m-instruct",
        help="a finished `mlx-stream train` folder (or several, comma-separated: their rows in order)",
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sequences", type=int, default=300, help="training sequences used (the first N)")
    ap.add_argument("--valid-sequences", type=int, default=50)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--stream-layers", type=int, default=2, help="msa: top layers the streams run through")
    ap.add_argument(
        "--archs",
        default="residual,hydra,msa",
        help="any of residual, hydra, msa, eagle (draft layer copied from the top layer), eagle-random, "
        "eagle3 (eagle on EAGLE-3's fused features: --fuse-layers), "
        "streamsN (trainable stream layers: the streams run through trainable copies of the top N layers)",
    )
    ap.add_argument("--stream-lr", type=float, default=1e-3, help="msa / streamsN learning rate")
    ap.add_argument("--stream-tokens", type=int, default=512, help="msa / streamsN padded tokens per step")
    ap.add_argument("--eagle-lr", type=float, default=5e-4)
    ap.add_argument("--eagle-steps", type=int, default=3, help="eagle: unroll steps (training-time test)")
    ap.add_argument("--eagle-tokens", type=int, default=4096, help="eagle: padded tokens per optimizer step")
    ap.add_argument("--eagle-warmup", type=int, default=50, help="eagle: warm-up steps")
    ap.add_argument("--eagle-reg", type=float, default=1.0, help="eagle: weight of the feature regression")
    ap.add_argument(
        "--fuse-layers",
        default="2,15",
        help="eagle3: the layers whose inputs are fused with the final feature",
    )
    ap.add_argument(
        "--features-cache",
        default="",
        help="a file keeping the sequence features between runs (same run, counts and model)",
    )
    ap.add_argument(
        "--reuse", action="store_true", help="with --save: evaluate heads saved there before, not train"
    )
    ap.add_argument("--out", default="compare_heads.json")
    ap.add_argument(
        "--save",
        default="",
        help="folder: each architecture's trained heads are saved in FOLDER/ARCH (tree 5-node)",
    )
    a = ap.parse_args()

    model, tok = load(a.model, heads=None, dtype="float32")
    archs = a.archs.split(",")
    depth = {arch: int(arch[7:]) if arch.startswith("streams") else a.stream_layers for arch in archs}
    K, layer = a.num_heads, len(model.backbone.layers) - max(depth.values())
    runs = [Path(r) for r in a.run.split(",")]
    fuse = [int(n) for n in a.fuse_layers.split(",")] if "eagle3" in archs else []
    attending = any(arch == "msa" or arch.startswith("streams") for arch in archs)
    tic = time.perf_counter()
    key = (
        tuple(str(r.resolve()) for r in runs),
        a.sequences,
        a.valid_sequences,
        layer,
        a.model,
        attending,
    )
    cached = Path(a.features_cache) if a.features_cache else None
    rows = {
        n: [r for run in runs for r in read_jsonl(run / "data" / f"{n}.jsonl")] for n in ("train", "valid")
    }
    rows = {"train": rows["train"][: a.sequences], "valid": rows["valid"][: a.valid_sequences]}
    got = pickle.loads(cached.read_bytes()) if cached and cached.is_file() else {}
    # a cache made with fused features serves the other architectures too (they read the first H)
    if got.get("key") == key and (got.get("fuse") == fuse or (not fuse and "fuse" in got)):
        tr_seqs, tr_fin, va_seqs, va_fin = got["tr"], got["tr_fin"], got["va"], got["va_fin"]
    else:
        if attending:  # the hidden states entering the stream layers, and the final ones
            tr_seqs, tr_fin = sequence_features(model, tok, rows["train"], layer)
            va_seqs, va_fin = sequence_features(model, tok, rows["valid"], layer)
        else:  # batched; with eagle3 every position also keeps the fused layers' inputs
            tr_seqs = eagle_features(model, tok, rows["train"], fuse_layers=fuse)
            va_seqs = eagle_features(model, tok, rows["valid"], fuse_layers=fuse)
            tr_fin, va_fin = [s.feats for s in tr_seqs], [s.feats for s in va_seqs]
        if cached:
            blob = {
                "key": key,
                "fuse": fuse,
                "tr": tr_seqs,
                "tr_fin": tr_fin,
                "va": va_seqs,
                "va_fin": va_fin,
            }
            tmp = cached.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(blob))
            tmp.replace(cached)
    H = model.backbone.args.hidden_size
    tr_fin, va_fin = [f[:, :H] for f in tr_fin], [f[:, :H] for f in va_fin]
    tr, va = position_cache(tr_seqs, tr_fin, K), position_cache(va_seqs, va_fin, K)
    print(
        f"features: {len(tr)} training / {len(va)} held-out positions in {time.perf_counter() - tic:.0f}s",
        flush=True,
    )
    ids, _ = choose_draft_vocab(tr, a.draft_vocab)
    ids = mx.array(ids)
    valid = np.asarray(va.targets[:, 1 : K + 1]) >= 0
    results = {}
    n_feat = len(tr_fin[0]) - len(tr_seqs[0].ids) + 1  # 1: finals of every position; 0: all but the last
    eagle_tr = [EagleSequence(s.ids, max(s.start, 1), f[: len(f) - n_feat]) for s, f in zip(tr_seqs, tr_fin)]
    eagle_va = [EagleSequence(s.ids, max(s.start, 1), f[: len(f) - n_feat]) for s, f in zip(va_seqs, va_fin)]
    if fuse:
        fused_tr = [EagleSequence(s.ids, max(s.start, 1), s.feats) for s in tr_seqs]
        fused_va = [EagleSequence(s.ids, max(s.start, 1), s.feats) for s in va_seqs]
    for arch in archs:
        heads = new_heads(
            model.backbone,
            tok,
            K,
            draft_ids=ids,
            architecture="msa"
            if arch.startswith("streams")
            else "eagle"
            if arch == "eagle3"
            else arch.split("-")[0],
            stream_layers=depth[arch],
            copy_top_layer=arch != "eagle-random",
            stream_copies=arch.startswith("streams"),
            fuse_layers=fuse if arch == "eagle3" else (),
        )
        seq_tr, seq_va = (fused_tr, fused_va) if arch == "eagle3" else (eagle_tr, eagle_va)
        reuse = a.reuse and a.save and (Path(a.save) / arch / "config.json").is_file()
        if reuse:  # evaluate the heads saved by an earlier run instead of training again
            heads = load_heads(Path(a.save) / arch)
        model.heads = heads
        tic = time.perf_counter()
        top = None
        if reuse:
            old = json.loads(Path(a.out).read_text())["results"] if Path(a.out).is_file() else {}
            old = old.get(arch, {})
            rep = {"positions_per_s": old.get("positions_per_s", float("nan"))}
            speed = rep["positions_per_s"]
            if arch.startswith("eagle"):
                top = evaluate_eagle(model, heads, seq_va, K)
                ranks = top[2]
            elif arch == "msa" or arch.startswith("streams"):
                skip = max(depth.values()) - depth[arch]
                ranks = stream_ranks(model, heads, advance(model, va_seqs, layer, skip))
            else:
                ranks = head_ranks(model, heads, va)
        elif arch.startswith("eagle"):
            rep = train_eagle(
                model,
                heads,
                seq_tr,
                epochs=a.epochs,
                lr=a.eagle_lr,
                steps=a.eagle_steps,
                tokens=a.eagle_tokens,
                warmup=a.eagle_warmup,
                reg_weight=a.eagle_reg,
                log=print,
            )
            speed = rep["positions_per_s"]
            top = evaluate_eagle(model, heads, seq_va, K)
            ranks = top[2]
        elif arch == "msa" or arch.startswith("streams"):
            skip = max(depth.values()) - depth[arch]  # frozen layers between the captured input and this N_s
            tr_s, va_s = advance(model, tr_seqs, layer, skip), advance(model, va_seqs, layer, skip)
            rep = train_stream_heads(
                model, heads, tr_s, epochs=a.epochs, lr=a.stream_lr, tokens=a.stream_tokens
            )
            speed = rep["positions_per_s"]
            ranks = stream_ranks(model, heads, va_s)
        else:
            cfg = TrainConfig(num_heads=K, epochs=a.epochs, checkpoint_every=0)
            rep = train_heads(model, heads, tr, Path(a.out).with_suffix("") / arch, cfg, progress=False)
            speed = rep["tokens_per_s"]
            ranks = head_ranks(model, heads, va)
        n = valid.sum(axis=0)
        tree5, tau5 = tree_from_ranks(ranks, 5)
        results[arch] = {
            "train_s": time.perf_counter() - tic,
            "positions_per_s": speed,
            "params": sum(v.size for _, v in tree_flatten(heads.trainable_parameters())),
            "top1": top[0]
            if top
            else [float(((ranks[:, j] == 0) & valid[:, j]).sum() / n[j]) for j in range(K)],
            "top5": top[1]
            if top
            else [
                float(((ranks[:, j] >= 0) & (ranks[:, j] < 5) & valid[:, j]).sum() / n[j]) for j in range(K)
            ],
            "tau_chain": tree_from_ranks(np.where(ranks > 0, -1, ranks), K)[1],
            "tau_5": tau5,
            "tree_5": format_tree(tree5),
            "tau_15": tree_from_ranks(ranks, 15)[1],
            "draft_ms": draft_times(model, [tree5])[0],
        }
        # this CPU's best tree: held-out tau / measured cost of drafting and verifying it
        tuned = tune_tree(model, heads, va, max_nodes=8, ranks=ranks)  # sets config.tree, tree_taus
        best = tuned["sizes"][tuned["best"]]
        results[arch] |= {
            "cpu_tree": best["tree"],
            "cpu_tau": best["tau"],
            "cpu_bound": best["speedup_bound"],
        }
        print(json.dumps({arch: results[arch]}), flush=True)
        if a.save:
            heads.config.trained_positions = len(tr)
            save_heads(heads, Path(a.save) / arch, dtype=mx.float16)
    Path(a.out).write_text(
        json.dumps(
            {"args": vars(a), "train_positions": len(tr), "valid_positions": len(va), "results": results},
            indent=2,
        )
    )
    print(
        "\n| heads | params | train pos/s | top-1 (heads 1..K) | top-5 | tau chain | tau 5-node "
        "| tau 15-node | draft ms | this CPU's best tree: tau, tau / cost |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arch, r in results.items():
        print(
            f"| {arch} | {r['params'] / 1e6:.2f}M | {r['positions_per_s']:.0f} | "
            f"{' / '.join(f'{x:.2f}' for x in r['top1'])} | {' / '.join(f'{x:.2f}' for x in r['top5'])} | "
            f"{r['tau_chain']:.2f} | {r['tau_5']:.2f} | {r['tau_15']:.2f} | {r['draft_ms']:.1f} | "
            f"`{r['cpu_tree']}`: {r['cpu_tau']:.2f}, {r['cpu_bound']:.2f} |"
        )


if __name__ == "__main__":
    main()
