"""`mlx-stream train` end to end: data -> feature cache -> heads, resumable at each stage.

Layout of the output folder::

    data/prompts.jsonl                     synthesised prompts (when no --data is given)
    data/train.jsonl, data/valid.jsonl     the dataset ({"prompt", "completion"} rows)
    features/train, features/valid         the frozen backbone's features (memory-mapped)
    checkpoint/                            the last training checkpoint (removed at the end)
    heads/                                 the trained heads (config.json + heads.safetensors)
                                           and the datastore of the answers they trained on
    report.json                            settings, timings, held-out accuracy, implied tau

The prompts are split into train and valid first. Self-distilled completions are
generated with continuous batching and their hidden states are kept from the same
forward passes, so the feature cache costs no second pass; rows that already have
a completion (``--no-distill``, raw text) are run through the backbone once. Each
split's cache grows sequence by sequence in ``features/<split>.partial`` and every
stage is skipped when its output exists, so rerunning the same command
(``--resume``) continues a killed run where it stopped.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import sys
import time
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_stream.distributed import Ranks, connect, launch_local, launched
from mlx_stream.files import write_json

from .data import prompt_ids, read_jsonl, split, synthesize_prompts, to_example, write_jsonl
from .features import FeatureWriter, load_features, sequence_ids, targets_for, teacher_forced
from .generation import generate_batch
from .trainer import TrainConfig, train_heads, tune_tree


def _log(msg: str) -> None:
    print(f"[train] {msg}", flush=True)


def _file_writers(out: Path, ranks: Ranks) -> bool:
    # whether this rank writes its machine's shared files (data, merged features): the
    # lowest rank among those that see the same --out folder (one machine, or a shared disk)
    if ranks.size == 1:
        return True
    token = ranks.broadcast_object(uuid.uuid4().hex)
    marks = out / ".ranks"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{token}.{ranks.rank}").touch()
    ranks.barrier()
    seen = [r for r in range(ranks.size) if (marks / f"{token}.{r}").exists()]
    ranks.barrier()
    (marks / f"{token}.{ranks.rank}").unlink()
    ranks.barrier()
    if ranks.rank == min(seen):
        shutil.rmtree(marks, ignore_errors=True)
    return ranks.rank == min(seen)


def load_rows(
    model,
    tokenizer,
    out: Path,
    data: str | None,
    synthesize: int,
    seed: int,
    ranks: Ranks | None = None,
    writer: bool = True,
) -> list[dict]:
    """The dataset's rows: the user's jsonl normalised to ``{"prompt", "completion"}``,
    or ``synthesize`` Magpie prompts (saved once as ``data/prompts.jsonl``, of which a
    rerun uses the first ``synthesize``). Rank 0 reads them and the other ``ranks``
    receive them; with more than one rank, rank r samples its share of the prompts
    with seed ``seed + r``, and the shares are interleaved and duplicates dropped.
    ``writer``: this rank writes ``data/prompts.jsonl`` (one rank per ``out`` folder).

    Raises:
        ValueError: fewer than 2 usable rows (one is held out).
    """
    ranks = ranks or Ranks()
    rows = None
    if data:
        if ranks.is_main:
            rows = [to_example(r, f"{data}:{i + 1}") for i, r in enumerate(read_jsonl(data))]
    elif ranks.is_main and (out / "data" / "prompts.jsonl").is_file():
        rows = read_jsonl(out / "data" / "prompts.jsonl")[:synthesize]
    rows = ranks.broadcast_object(rows)
    if rows is None:
        tic = time.perf_counter()
        n = ranks.size
        if n > 1:
            share = synthesize // n + (ranks.rank < synthesize % n)
            log = lambda m: _log(f"[rank {ranks.rank}, seed {seed + ranks.rank}] {m}")  # noqa: E731
            per = ranks.gather(synthesize_prompts(model, tokenizer, share, seed=seed + ranks.rank, log=log))
            # round-robin, so the first 2m prompts of any run are those of a run asked for 2m
            seen, prompts = set(), []
            for i in range(max(map(len, per))):
                for ps in per:
                    if i < len(ps) and ps[i].lower() not in seen:
                        seen.add(ps[i].lower())
                        prompts.append(ps[i])
        else:
            prompts = synthesize_prompts(model, tokenizer, synthesize, seed=seed, log=_log)
        _log(f"synthesised {len(prompts)} prompts (Magpie) in {time.perf_counter() - tic:.0f}s")
        rows = [{"prompt": p, "completion": None} for p in prompts]
        if writer:
            write_jsonl(rows, out / "data" / "prompts.jsonl")
    if len(rows) < 2:
        raise ValueError(
            f"only {len(rows)} usable prompts ({'from ' + data if data else 'synthesised'}): "
            "training needs at least 2 (one is held out); give a larger --data file or --synthesize"
        )
    return rows


def distill_part(
    model,
    tokenizer,
    rows: list[dict],
    todo: list[int],
    part: Path,
    num_heads: int,
    max_tokens: int,
    batch_size: int,
    label: str = "",
    top_k: int = 0,
) -> None:
    """Self-distil ``rows[i]`` for ``i`` in ``todo`` into the feature cache folder ``part``
    (hidden states, and the top-``top_k`` log-probabilities, kept from the generation
    itself; ``rows.jsonl`` beside them holds ``{"index", "prompt", "completion"}``).
    Resumes a partial part; returns at once when ``part`` is complete."""
    if (part / "meta.json").is_file():
        return
    writer = FeatureWriter(part, model.state_size, num_heads, resume=True, top_k=top_k)
    try:
        done = {r["index"] for r in writer.rows}
        todo = [i for i in todo if i not in done]
        prompts = [prompt_ids(tokenizer, rows[i]["prompt"]) for i in todo]
        eos = set(tokenizer.eos_token_ids)
        total, n0, tic, last = len(done) + len(todo), writer.positions, time.perf_counter(), 0.0
        for k, g in generate_batch(
            model, prompts, max_tokens, eos_ids=eos, keep_hidden=True, batch_size=batch_size, top_k=top_k
        ):
            i, ids = todo[k], prompts[k] + g.tokens
            text = tokenizer.decode([t for t in g.tokens if t not in eos])
            writer.add(
                g.hidden,
                targets_for(ids, len(prompts[k]), num_heads),
                # the tokens as generated: decoding and re-encoding the text need not give them back
                {"index": i, "prompt": rows[i]["prompt"], "completion": text, "completion_ids": g.tokens},
                g.top_logprobs,
                g.top_ids,
            )
            now = time.perf_counter() - tic
            if now - last > 60 or writer.sequences == total:
                last = now
                _log(
                    f"{label}self-distilled {writer.sequences}/{total} sequences, "
                    f"{writer.positions} positions, "
                    f"{(writer.positions - n0) / now:.1f} tok/s"
                )
        writer.finish(keep_rows=True)
    finally:
        writer.close()


def _older_stamp(parts_dir: Path) -> dict | None:
    # an interrupted run of a version that stamped only the rows: its parts, finished or not
    old = parts_dir / "rows.sha256"
    if not old.is_file():
        return None
    names = {d.name.removesuffix(".partial") for d in parts_dir.iterdir() if d.is_dir()}
    return {"rows": old.read_text(), "parts": len([n for n in names if n.isdigit()])}


def build_split(
    model,
    tokenizer,
    rows: list[dict],
    out: Path,
    name: str,
    num_heads: int,
    distill: bool,
    max_tokens: int,
    batch_size: int,
    fingerprint: dict,
    top_k: int = 0,
    ranks: Ranks | None = None,
    writer: bool = True,
):
    """Features (and ``data/<name>.jsonl``) for one split, resuming a partial build.

    Rows with a prompt get the backbone's own greedy completion when ``distill`` is
    set or they have none: :func:`distill_part`, one part per rank (rank r distils
    rows r, r + size, ... of them into ``features/<name>.parts/r``; a resumed run keeps
    the interrupted run's parts, rank r continuing parts r, r + size, ...). Finished
    parts are copied to the machines that lack them; then one rank per ``out`` folder
    (``writer``) merges them with the rows that keep their completions (raw text, run
    through the backbone once, batched: :func:`mlx_stream.train.features.teacher_forced`)
    and every rank loads the result. ``top_k`` > 0 also stores the backbone's top-k
    log-probabilities per position (soft targets).

    Raises:
        ValueError: ``out`` holds the parts of an interrupted run on other rows.
    """
    ranks = ranks or Ranks()
    needs = [r["prompt"] != "" and (distill or r["completion"] is None) for r in rows]
    todo = [i for i in range(len(rows)) if needs[i]]
    parts_dir = out / "features" / f"{name}.parts"
    # the parts index into ``rows`` and each takes every count-th of them: resuming them is only
    # sound for the very same rows and count, so both are stamped before any part is begun (a
    # listing of the parts would also see a kill's ``<w>.partial`` and miss a part not yet begun)
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    stamp = parts_dir / "parts.json"
    prior = json.loads(stamp.read_text()) if stamp.is_file() else _older_stamp(parts_dir)
    if prior is not None and prior["rows"] != digest:
        raise ValueError(
            f"{parts_dir}: an interrupted run on a different dataset (other --data, --synthesize or "
            f"--seed); rerun it with the same options, or delete {parts_dir} to start this one"
        )
    # the shares must stay those of the interrupted run (rank 0's folder says which)
    count = ranks.broadcast_object((prior or {}).get("parts") or min(ranks.size, len(todo)))
    started = prior is not None
    ranks.barrier()  # every rank has read the stamp before it is written
    if writer:
        parts_dir.mkdir(parents=True, exist_ok=True)
        write_json({"rows": digest, "parts": count}, stamp)
    ranks.barrier()  # and no part is begun before it is
    if started and count != ranks.size:
        _log(f"{name}: resuming the {count} part(s) of the interrupted run on {ranks.size} rank(s)")
    parts = [parts_dir / str(w) for w in range(count)]
    for w in range(ranks.rank, count, ranks.size):
        label = f"{name}: " if count == 1 else f"{name} [{w + 1}/{count}]: "
        distill_part(
            model, tokenizer, rows, todo[w::count], parts[w], num_heads, max_tokens, batch_size, label, top_k
        )
    for w, part in enumerate(parts):  # to the machines without a shared disk
        ranks.share_folder(part, owner=w % ranks.size, want=writer and not (part / "meta.json").is_file())
    ranks.barrier()
    if writer:
        writer_ = FeatureWriter(out / "features" / name, model.state_size, num_heads, top_k=top_k)
        try:
            given = [i for i in range(len(rows)) if not needs[i]]
            seqs = [sequence_ids(tokenizer, rows[i]) for i in given]
            for k, h, lp, ti in teacher_forced(model, seqs, top_k):  # rows are re-sorted below
                ids, start = seqs[k]
                writer_.add(
                    h, targets_for(ids, start, num_heads), {"index": given[k], **rows[given[k]]}, lp, ti
                )
            for part in parts:
                writer_.extend(load_features(part))
            kept = sorted(writer_.rows, key=lambda r: r["index"])
            write_jsonl(
                ({k: v for k, v in r.items() if k != "index"} for r in kept), out / "data" / f"{name}.jsonl"
            )
            writer_.finish(fingerprint)
        finally:
            writer_.close()
        shutil.rmtree(parts_dir, ignore_errors=True)
    ranks.barrier()
    return load_features(out / "features" / name)


def choose_draft_vocab(feats, size: int) -> tuple[np.ndarray, float]:
    """The ``size`` most frequent target tokens of the training features, and the
    fraction of training targets they cover."""
    tg = np.asarray(feats.targets[:, 1:]).reshape(-1)
    counts = np.bincount(tg[tg >= 0])
    ids = np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)
    return ids, float(counts[ids].sum() / max(counts.sum(), 1))


def _train_eagle(
    model, tokenizer, heads, out: Path, cfg: TrainConfig, trees: dict
) -> tuple[dict, np.ndarray]:
    # the draft layer reads whole sequences: features of every position of the run's rows
    # (one batched teacher-forced prefill per split), then sequence batches of 256 tokens
    from mlx_stream.heads import save_heads

    from .eagle import evaluate_eagle, published, sequence_features, train_eagle
    from .trainer import implied_tau

    tic = time.perf_counter()
    seqs = {
        n: sequence_features(
            model, tokenizer, read_jsonl(out / "data" / f"{n}.jsonl"), fuse_layers=heads.config.fuse_layers
        )
        for n in ("train", "valid")
    }
    _log(
        f"sequence features: {len(seqs['train'])} + {len(seqs['valid'])} sequences "
        f"in {time.perf_counter() - tic:.0f}s"
    )
    depth = heads.config.num_heads  # (a published drafter's own: EAGLE-3 6, MTP 3)
    report = train_eagle(
        model,
        heads,
        seqs["train"],
        epochs=cfg.epochs,
        lr=cfg.lr,
        steps=min(3, depth),
        reg_weight=0.0 if published(heads) else 1.0,  # EAGLE-3 and MTP train on the tokens alone
        warmup=cfg.warmup,
        seed=cfg.seed,
        step_decay=cfg.head_decay,
        log=_log,
    )
    heads.config.trained_positions += report["positions"]
    top1, top5, ranks = evaluate_eagle(model, heads, seqs["valid"], depth)
    report["valid"] = {
        "positions": int(len(ranks)),
        "top1": top1,
        "top5": top5,
        "tau": {name: implied_tau(ranks, choices) for name, choices in trees.items()},
    }
    report["train_positions"] = report["positions"]
    save_heads(heads, out / "heads", dtype=mx.float16)
    return report, ranks


_NO_DFLASH = (
    "{where}: a published DFlash block drafter; fine-tuning one is not supported (its block-diffusion "
    "training is not built here): EAGLE-3 layers and MTP modules are"
)


def published_drafter(init_heads) -> str | None:
    """The kind of published drafter ``init_heads`` names, ``"EAGLE-3"``, ``"MTP"`` or
    ``"DFlash"``: a checkpoint folder as published, ``"mtp"`` (the target checkpoint's own
    module), or one saved in our format (loaded, or fine-tuned before); None for our own
    heads (or none)."""
    from mlx_stream.drafters.dflash import is_dflash
    from mlx_stream.drafters.eagle3 import is_eagle3
    from mlx_stream.drafters.mtp import MTP_HEADS

    if init_heads is None:
        return None
    if str(init_heads) == MTP_HEADS:
        return "MTP"
    if is_eagle3(init_heads):
        return "EAGLE-3"
    if is_dflash(init_heads):
        return "DFlash"
    try:
        raw = json.loads((Path(init_heads) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # (load_heads says what is wrong with the folder)
    if not isinstance(raw, dict):
        return None
    if raw.get("eagle3"):
        return "EAGLE-3"
    if raw.get("mtp"):
        return "MTP"
    return "DFlash" if raw.get("architecture") == "dflash" else None


def check_init_heads(config, cfg: TrainConfig, architecture: str, where: str) -> None:
    """Check that heads saved with ``config`` can continue training under ``cfg``. A
    published EAGLE-3 layer or MTP module (``config.eagle3`` / ``config.mtp``) trains as
    an eagle layer at its own depth and width, whatever ``cfg`` asks of new heads.

    Raises:
        ValueError: a DFlash block drafter (not trained here); naming the first setting
            that differs (architecture, number of heads, layers per head).
    """
    if config.architecture == "dflash":
        raise ValueError(_NO_DFLASH.format(where=where))
    if config.eagle3 or config.mtp:
        if architecture != "eagle":
            raise ValueError(
                f"{where}: a published {'EAGLE-3' if config.eagle3 else 'MTP'} drafter trains as an "
                f"eagle layer, not {architecture!r}: leave --architecture out (or pass eagle)"
            )
        return
    for name, have, want in (
        ("architecture", config.architecture, architecture),
        ("num_heads", config.num_heads, cfg.num_heads),
        ("num_layers", config.num_layers, cfg.num_layers),
    ):
        if have != want:
            flag = {
                "architecture": "--architecture",
                "num_heads": "--num-heads",
                "num_layers": "--num-layers",
            }
            raise ValueError(
                f"{where}: heads with {name} {have!r}, but this run asks for {want!r}; "
                f"pass {flag[name]} {have} to continue them"
            )


def check_run_settings(
    max_tokens: int = 256,
    workers: int = 1,
    gen_batch_size: int = 64,
    draft_vocab: int = 0,
    architecture: str = "hydra",
    top_k: int = 0,
) -> None:
    """Check :func:`run`'s data and heads settings before anything is loaded or written.

    Raises:
        ValueError: a count below 1 (``draft_vocab`` and ``top_k`` below 0), or an architecture that
            ``run`` does not train (msa heads train on whole sequences:
            ``benchmarks/compare_heads.py``).
    """
    from mlx_stream.heads import ARCHITECTURES

    for name, v in (("max_tokens", max_tokens), ("workers", workers), ("gen_batch_size", gen_batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 0:
        raise ValueError(
            f"draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {draft_vocab!r}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= 1024:
        raise ValueError(f"soft targets (top_k) must be an integer in 0..1024 (0: none), got {top_k!r}")
    if architecture == "msa":
        raise ValueError(
            "msa heads train on whole sequences and are not trained by `mlx-stream train`; they are "
            "compared in benchmarks/compare_heads.py (docs/benchmarks.md, 'Head architectures and "
            "ablations': hydra heads are better with a frozen backbone)"
        )
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; use one of: hydra, residual, eagle")


def run(
    model_spec: str,
    out: str | Path,
    cfg: TrainConfig,
    data: str | None = None,
    synthesize: int = 512,
    distill: bool = True,
    max_tokens: int = 256,
    valid_fraction: float = 0.05,
    resume: bool = False,
    dtype: str = "float32",
    progress: bool = True,
    draft_vocab: int = 0,
    architecture: str | None = None,
    gen_batch_size: int = 64,
    workers: int = 1,
    tune: bool = True,
    top_k: int = 0,
    init_heads: str | Path | None = None,
    connect_timeout: float = 120.0,
) -> dict | None:
    """Train stream heads for ``model_spec``; see the module docstring for the layout.
    With ``tune``, the heads are saved with the draft tree that scores best on the
    held-out data and this machine's forward costs (:func:`tune_tree`). ``top_k`` > 0
    stores the backbone's top-k log-probabilities with the features (the soft targets
    that ``cfg.kl_weight`` weighs). ``init_heads`` continues training heads saved
    before (same architecture, K, layers and backbone) on this run's data, with the
    draft vocabulary chosen from this run's data like a fresh run's (the heads'
    weights do not depend on it: it only selects rows of the frozen output
    projection); the report's ``positions_seen_total`` and the heads'
    ``trained_positions`` add this run's positions to theirs.

    Under a distributed launcher (``mlx.launch``; :mod:`mlx_stream.distributed`) the run
    is one rank of a job: the ranks split the self-distillation (:func:`build_split`)
    and train data-parallel with the same global batches (:func:`train_heads`), so the
    heads are those of a one-rank run; rank 0 writes the heads and ``report.json`` and
    returns the report, the other ranks return None. ``workers`` > 1 outside a
    launcher starts that many ranks on this machine (:func:`launch_local`) and returns
    rank 0's report. ``connect_timeout``: seconds to wait for the ranks to connect.

    Raises:
        ValueError: ``out`` holds a previous run and ``resume`` is False; too few rows;
            an unknown architecture; ``init_heads`` of another shape or backbone.
        FileNotFoundError: ``init_heads`` is not a heads folder.
        RuntimeError: a rank started by ``workers`` failed (rerun with ``resume``).
    """
    from mlx_stream.heads import backbone_fingerprint, load_heads, new_heads, save_heads
    from mlx_stream.loader import load
    from mlx_stream.tree import chain, sparse

    kind = published_drafter(init_heads)
    if kind == "DFlash":
        raise ValueError(_NO_DFLASH.format(where=init_heads))
    architecture = architecture or ("eagle" if kind else "hydra")
    check_run_settings(
        max_tokens=max_tokens,
        workers=workers,
        gen_batch_size=gen_batch_size,
        draft_vocab=draft_vocab,
        architecture=architecture,
        top_k=top_k,
    )
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise ValueError(f"{out}: holds a previous run; pass --resume to continue it or choose another --out")
    if workers > 1 and not launched():  # the same distributed run, its ranks on this machine
        args = {k: v for k, v in locals().items() if k in inspect.signature(run).parameters}
        args["workers"] = 1
        _log(f"{workers} ranks on this machine (mlx.distributed, ring backend on 127.0.0.1)")
        try:
            launch_local(workers, _rank_run, (args,))
        except RuntimeError as e:
            raise RuntimeError(f"{e}; rerun with --resume") from e
        return json.loads((out / "report.json").read_text())
    ranks = connect(connect_timeout)
    if ranks.size > 1:
        _log(f"rank {ranks.rank} of {ranks.size} ({ranks.local_size} on this machine)")
    say = _log if ranks.is_main else lambda m: None  # (each rank logs its own distillation)
    tic = time.perf_counter()
    model, tokenizer = load(model_spec, heads=None, dtype=dtype)
    writer = _file_writers(out, ranks)
    fp = backbone_fingerprint(model.backbone, tokenizer)
    init = None
    if init_heads is not None:
        from mlx_stream.drafters.eagle3 import is_eagle3, load_eagle3
        from mlx_stream.drafters.mtp import MTP_HEADS, load_mtp
        from mlx_stream.loader import resolve_model_path

        # a published checkpoint (or the target's own MTP module) is read and checked against
        # this target as decoding reads it; heads saved in our format (a fine-tuned one too) as ours
        if str(init_heads) == MTP_HEADS:
            init = load_mtp(resolve_model_path(model_spec), model.backbone, fp)
        elif is_eagle3(init_heads):
            init = load_eagle3(init_heads, model.backbone, fp)
        else:
            init = load_heads(init_heads, fingerprint=fp)
        check_init_heads(init.config, cfg, architecture, str(init_heads))
    feats, splits = {}, None
    for name in ("train", "valid"):
        have = (out / "features" / name / "meta.json").is_file()
        if ranks.broadcast_object(have):  # rank 0 has them: the machines that lack them get a copy
            ranks.share_folder(out / "features" / name, owner=0, want=writer and not have)
            ranks.barrier()
            feats[name] = load_features(out / "features" / name)
        else:
            if splits is None:
                rows = load_rows(model, tokenizer, out, data, synthesize, cfg.seed, ranks, writer)
                splits = dict(zip(("train", "valid"), split(rows, valid_fraction, cfg.seed)))
            feats[name] = build_split(
                model,
                tokenizer,
                splits[name],
                out,
                name,
                cfg.num_heads,
                distill,
                max_tokens,
                gen_batch_size,
                fp,
                top_k=top_k,
                ranks=ranks,
                writer=writer,
            )
        if feats[name].num_heads < cfg.num_heads:
            raise ValueError(
                f"{out / 'features' / name}: built for {feats[name].num_heads} heads; "
                f"delete it to rebuild for {cfg.num_heads}"
            )
    data_s = time.perf_counter() - tic
    say(f"{len(feats['train'])} training positions, {len(feats['valid'])} held out")
    ids, coverage = None, 1.0
    if kind is not None:  # a published drafter keeps the vocabulary (and head) it was trained with
        coverage = None
        say(f"fine-tuning a published {kind} drafter: it keeps its own vocabulary and depth")
    elif 0 < draft_vocab < model.args.vocab_size:
        ids, coverage = choose_draft_vocab(feats["train"], draft_vocab)
        say(f"draft vocabulary: {len(ids)} tokens covering {coverage:.1%} of training targets")
        ids = mx.array(ids)
    done = resume and (out / "heads" / "config.json").is_file() and (out / "report.json").is_file()
    if ranks.broadcast_object(done):
        say(f"{out / 'heads'} is already trained; delete it (and report.json) to train again")
        if ranks.is_main and not (out / "heads" / "datastore.npz").is_file():  # killed before it was saved
            write_datastore(out, tokenizer, fp["tokenizer"], init_heads)
        return json.loads((out / "report.json").read_text()) if ranks.is_main else None
    if init is None:
        heads = new_heads(
            model.backbone, tokenizer, cfg.num_heads, cfg.num_layers, draft_ids=ids, architecture=architecture
        )
    elif kind is not None:
        heads = init
    else:  # the heads' weights do not depend on the draft vocabulary: it only picks output rows
        heads = init
        heads.config.draft_vocab_size = 0 if ids is None else len(ids)
        if ids is None:
            heads.pop("draft_ids", None)  # the full vocabulary
        else:
            heads.set_draft_vocab(ids)
    seen_before = heads.config.trained_positions
    trees = {"chain": chain(cfg.num_heads).choices, "sparse": sparse(cfg.num_heads).choices}
    eagle_ranks = None
    if architecture == "eagle":  # on rank 0 alone (the data stage above was spread over the ranks)
        if not ranks.is_main:
            return None
        if ranks.size > 1:
            _log("the eagle draft layer trains on rank 0 alone (the other ranks are done)")
        report, eagle_ranks = _train_eagle(model, tokenizer, heads, out, cfg, trees)
    else:
        report = train_heads(
            model,
            heads,
            feats["train"],
            out,
            cfg,
            valid=feats["valid"],
            resume=resume,
            progress=progress,
            trees=trees,
            ranks=ranks,
        )
        if not ranks.is_main:
            return None
    if tune and len(feats["valid"]):
        report["tree_search"] = tune_tree(model, heads, feats["valid"], ranks=eagle_ranks)
        best = report["tree_search"]["sizes"][report["tree_search"]["best"]]
        _log(f"tree for these heads: {best['tree']} (tau {best['tau']:.2f}, cost {best['cost']:.2f})")
        save_heads(heads, out / "heads", dtype=mx.float16)
    report["datastore_tokens"] = write_datastore(out, tokenizer, fp["tokenizer"], init_heads)
    report["init_heads"] = str(init_heads) if init_heads is not None else None
    report["positions_seen_total"] = heads.config.trained_positions
    report["positions_seen_before"] = seen_before
    report["total_wall_s"] = time.perf_counter() - tic
    report["data_and_features_s"] = data_s
    report["model"] = model_spec
    report["architecture"] = architecture
    report["data_tokens"] = {k: int(len(v)) for k, v in feats.items()}
    report["draft_vocab_coverage"] = coverage
    report["ranks"] = ranks.size
    write_json(report, out / "report.json")
    return report


def write_datastore(
    out: Path, tokenizer, tokenizer_hash: str, init_heads=None, max_tokens: int = 1 << 21
) -> int:
    """Save the answers the heads trained on (``data/train.jsonl``'s completions: the
    backbone's own, self-distilled, unless ``--no-distill``) as a datastore beside
    them (``heads/datastore.npz``, :mod:`mlx_stream.datastore`), after the store of
    ``init_heads`` if that has one, keeping the latest ``max_tokens``. Returns the
    tokens stored."""
    from mlx_stream.datastore import SEP, STORE_FILE, Datastore, keep_latest, read_tokens, save_store

    parts = []
    if init_heads is not None and (Path(init_heads) / STORE_FILE).is_file():
        parts.append(read_tokens(Path(init_heads) / STORE_FILE, tokenizer_hash)[0])
    answers = [r["completion"] for r in read_jsonl(out / "data" / "train.jsonl") if r.get("completion")]
    for a in answers:
        parts += [
            np.asarray(tokenizer.encode(a, add_special_tokens=False), np.int32),
            np.array([SEP], np.int32),
        ]
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    tokens = keep_latest(tokens, max_tokens)
    save_store(Datastore(tokens), out / "heads" / STORE_FILE, tokenizer_hash)
    return int((tokens != SEP).sum())


def _rank_run(kwargs: dict) -> None:  # one rank of run(workers=N): a spawned process
    try:
        run(**kwargs)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
