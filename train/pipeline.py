"""`mlx-stream train` end to end: data -> feature cache -> heads, resumable at each stage.

Layout of the output folder::

    data/train.jsonl, data/valid.jsonl    the dataset ({"prompt", "completion"} rows)
    features/train, features/valid        the frozen backbone's features (memory-mapped)
    checkpoint/                           the last training checkpoint (removed at the end)
    heads/                                the trained heads (config.json + heads.safetensors)
    report.json                           settings, timings, held-out accuracy, implied tau

Every stage writes atomically and is skipped when its output exists, so rerunning
the same command (``--resume``) continues a killed run where it stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .data import read_jsonl, self_distill, split, synthesize_prompts, to_example, write_jsonl
from .features import build_features, load_features
from .trainer import TrainConfig, train_heads


def _log(msg: str) -> None:
    print(f"[train] {msg}", flush=True)


def _complete_rows(path: Path) -> list[dict]:
    """Rows of an append-only jsonl log, dropping a last line cut off by a kill (the
    file is rewritten without it)."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for line in lines:
        if not line.endswith("\n"):
            break
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    if len(rows) != len(lines):
        write_jsonl(rows, path)
    return rows


def prepare_data(model, tokenizer, out: Path, data: str | None, synthesize: int, distill: bool,
                 max_tokens: int, valid_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """The train/valid rows: read from ``out/data`` when present, else built and saved.

    Synthesised prompts are saved first (``data/prompts.jsonl``) and distilled rows are
    appended batch by batch (``data/distilled.jsonl``), so a killed run resumes
    without redoing either.
    """
    d = out / "data"
    tr_path, va_path = d / "train.jsonl", d / "valid.jsonl"
    if tr_path.is_file() and va_path.is_file():
        return read_jsonl(tr_path), read_jsonl(va_path)
    if data:
        rows = [to_example(r, f"{data}:{i + 1}") for i, r in enumerate(read_jsonl(data))]
    elif (d / "prompts.jsonl").is_file():
        rows = read_jsonl(d / "prompts.jsonl")
    else:
        tic = time.perf_counter()
        prompts = synthesize_prompts(model, tokenizer, synthesize, seed=seed)
        _log(f"synthesised {len(prompts)} prompts (Magpie) in {time.perf_counter() - tic:.0f}s")
        rows = [{"prompt": p, "completion": None} for p in prompts]
        write_jsonl(rows, d / "prompts.jsonl")
    # rows with a prompt get the backbone's own completion (always when they have none);
    # raw-text rows have no prompt to answer and are kept as they are
    needs = [r["prompt"] != "" and (distill or r["completion"] is None) for r in rows]
    todo = [r for r, n in zip(rows, needs) if n]
    if todo:
        log = d / "distilled.jsonl"
        done = _complete_rows(log)
        d.mkdir(parents=True, exist_ok=True)
        tic = time.perf_counter()
        with log.open("a", encoding="utf-8") as f:
            for i in range(len(done), len(todo), 16):
                new = self_distill(model, tokenizer, [r["prompt"] for r in todo[i : i + 16]], max_tokens=max_tokens)
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))
                f.flush()
                done += new
                _log(f"self-distilled {len(done)}/{len(todo)}")
        _log(f"self-distillation took {time.perf_counter() - tic:.0f}s")
        rows = [r for r, n in zip(rows, needs) if not n] + done
    if len(rows) < 2:
        raise ValueError(
            f"only {len(rows)} usable prompts ({'from ' + data if data else 'synthesised'}): "
            "training needs at least 2 (one is held out); give a larger --data file or --synthesize"
        )
    train, valid = split(rows, valid_fraction, seed)
    write_jsonl(valid, va_path)
    write_jsonl(train, tr_path)
    return train, valid


def choose_draft_vocab(feats, size: int) -> tuple[np.ndarray, float]:
    """The ``size`` most frequent target tokens of the training features, and the
    fraction of training targets they cover."""
    tg = np.asarray(feats.targets[:, 1:]).reshape(-1)
    counts = np.bincount(tg[tg >= 0])
    ids = np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)
    return ids, float(counts[ids].sum() / max(counts.sum(), 1))


def run(model_spec: str, out: str | Path, cfg: TrainConfig, data: str | None = None, synthesize: int = 512,
        distill: bool = True, max_tokens: int = 256, valid_fraction: float = 0.05, resume: bool = False,
        dtype: str = "float32", progress: bool = True, draft_vocab: int = 0) -> dict:
    """Train stream heads for ``model_spec``; see the module docstring for the layout.

    Raises:
        ValueError: ``out`` holds a previous run and ``resume`` is False.
    """
    from mlx_stream.heads import backbone_fingerprint, new_heads
    from mlx_stream.loader import load
    from mlx_stream.tree import chain, sparse

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise ValueError(f"{out}: holds a previous run; pass --resume to continue it or choose another --out")
    tic = time.perf_counter()
    model, tokenizer = load(model_spec, dtype=dtype)
    fp = backbone_fingerprint(model.backbone, tokenizer)
    train_rows, valid_rows = prepare_data(model, tokenizer, out, data, synthesize, distill, max_tokens,
                                          valid_fraction, cfg.seed)
    feats = {}
    for name, rows in (("train", train_rows), ("valid", valid_rows)):
        path = out / "features" / name
        try:
            feats[name] = load_features(path)
        except FileNotFoundError:
            feats[name] = build_features(model, tokenizer, rows, path, cfg.num_heads, fingerprint=fp)
        if feats[name].num_heads < cfg.num_heads:
            raise ValueError(f"{path}: built for {feats[name].num_heads} heads; delete it to rebuild for {cfg.num_heads}")
    _log(f"{len(feats['train'])} training positions, {len(feats['valid'])} held out")
    ids, coverage = None, 1.0
    if 0 < draft_vocab < model.args.vocab_size:
        ids, coverage = choose_draft_vocab(feats["train"], draft_vocab)
        _log(f"draft vocabulary: {len(ids)} tokens covering {coverage:.1%} of training targets")
        ids = mx.array(ids)
    heads = new_heads(model.backbone, tokenizer, cfg.num_heads, cfg.num_layers, draft_ids=ids)
    trees = {"chain": chain(cfg.num_heads).choices, "sparse": sparse(cfg.num_heads).choices}
    report = train_heads(model, heads, feats["train"], out, cfg, valid=feats["valid"], resume=resume,
                         progress=progress, trees=trees)
    report["total_wall_s"] = time.perf_counter() - tic
    report["model"] = model_spec
    report["data_tokens"] = {k: int(len(v)) for k, v in feats.items()}
    report["draft_vocab_coverage"] = coverage
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
