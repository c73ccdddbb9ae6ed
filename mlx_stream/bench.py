"""Side-by-side measurement against plain mlx-lm (same model object, same process).

Prompts are run interleaved (mlx-lm, then mlx-stream, per prompt) after a warm-up,
so machine drift hits both; ratios are per prompt and summarised by the median.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from .cost import forward_cost
from .distributed import Ranks, launch_local, shard
from .files import atomic_write, write_json
from .prompts import prompt_ids


@dataclass
class PromptResult:
    """One prompt's side-by-side result. Speeds are decode tokens/s, prefill excluded, both
    sides timed alike (:func:`timed_tokens`)."""

    prompt: int
    tokens: int
    plain_tps: float
    spec_tps: float
    tau: float
    identical: bool | None  # None when sampling (outputs differ by chance)

    @property
    def speedup(self) -> float:
        # an answer of one token decodes nothing: neither side is faster
        return self.spec_tps / self.plain_tps if self.plain_tps and self.spec_tps else 1.0


def timed_tokens(
    responses: Iterable, tokens: Callable, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[int], float, object]:
    """Consume a stream of generation responses with one stopwatch for every decoder.

    mlx-lm's ``generation_tps`` and ours count differently where a generation ends at
    EOS (mlx-lm's last rate before its EOS response leaves out the EOS step, which ours
    includes), which biases a ratio of the two by about one step per prompt. Here both are
    timed alike: from the arrival of the first response to that of the last (the step
    that found EOS, or the token at ``max_tokens``), over the tokens after the first
    response's.

    Args:
        responses: an iterator of responses (``mlx_lm.stream_generate``'s or ours).
        tokens: ``f(response) -> list[int]`` the tokens a response delivers (EOS left out).
        clock: seconds, read as each response arrives.

    Returns:
        ``(tokens, decode tokens/s, last response)``; the speed is 0.0 when fewer than two
        responses arrive or no token follows the first response's.
    """
    out, first, last, last_t, n_first = [], None, None, 0.0, 0
    for last in responses:
        last_t = clock()
        got = tokens(last)
        if first is None:
            first, n_first = last_t, len(got)
        out.extend(got)
    after = len(out) - n_first
    rate = after / (last_t - first) if first is not None and after > 0 and last_t > first else 0.0
    return out, rate, last


@dataclass
class Decoding:
    """How mlx-stream decodes in a bench or an evaluation (what it passes on to
    :func:`mlx_stream.stream_generate`; picklable, for worker processes).

    Attributes:
        max_tokens: tokens per prompt.
        tree: a tree spec (:func:`mlx_stream.speculation.resolve_tree`).
        prompt_lookup: as :func:`mlx_stream.stream_generate` (None: its default).
        sampling: ``temp``, ``top_p``, ``top_k``, ``min_p``; greedy when empty or ``temp == 0``.
        num_draft_tokens: the draft model's chain length (``model.draft_model``), None: its tree.
        adaptive: as :func:`mlx_stream.stream_generate` (None: its default, on).
    """

    max_tokens: int = 128
    tree: str | None = None
    prompt_lookup: int | None = None
    sampling: dict = field(default_factory=dict)
    num_draft_tokens: int | None = None
    adaptive: bool | None = None

    @property
    def greedy(self) -> bool:
        return not self.sampling.get("temp")

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`mlx_stream.stream_generate`."""
        return {
            "max_tokens": self.max_tokens,
            "tree": self.tree,
            "prompt_lookup": self.prompt_lookup,
            "num_draft_tokens": self.num_draft_tokens,
            "adaptive": self.adaptive,
            **self.sampling,
        }


def compare(
    model,
    tokenizer,
    prompts: Sequence[str],
    decoding: Decoding,
    make_drafter: Callable | None = None,
    progress: Callable[[PromptResult], None] | None = None,
    seed: int = 0,
    indices: Sequence[int] | None = None,
) -> list[PromptResult]:
    """Decoding of each prompt (through the chat template) by plain
    ``mlx_lm.stream_generate`` and by :func:`mlx_stream.stream_generate`, interleaved.
    ``indices``: each prompt's number (its result's ``index`` and seed; default 0, 1, ...).

    Args:
        decoding: mlx-stream's settings; plain mlx-lm samples with ``make_sampler`` of
            the same sampling settings, both seeded with ``seed + i`` for prompt i.
            Identity is checked only when greedy.
        make_drafter: ``f(prompt_ids, reference_tokens) -> Drafter`` (e.g. the
            oracle); ``None`` drafts with the model's heads and ``decoding.tree``.
    """
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from .generate import stream_generate

    s = decoding.sampling
    sampler = (
        None
        if decoding.greedy
        else make_sampler(
            temp=s["temp"], top_p=s.get("top_p", 1.0), min_p=s.get("min_p", 0.0), top_k=s.get("top_k", 0)
        )
    )
    # warm-up: both paths, so one-time costs hit neither measurement
    warm = prompt_ids(tokenizer, "Hello")
    for _ in mlx_lm.stream_generate(model, tokenizer, mx.array(warm), max_tokens=8):
        pass
    for _ in stream_generate(model, tokenizer, warm, **(decoding.kwargs() | {"max_tokens": 8})):
        pass
    eos = set(tokenizer.eos_token_ids)

    def not_eos(r):
        return [] if r.token in eos else [r.token]

    results = []
    for i, p in zip(indices if indices is not None else range(len(prompts)), prompts):
        ids = prompt_ids(tokenizer, p)
        mx.random.seed(seed + i)
        ref, plain_tps, _ = timed_tokens(
            mlx_lm.stream_generate(
                model, tokenizer, mx.array(ids), max_tokens=decoding.max_tokens, sampler=sampler
            ),
            not_eos,
        )
        drafter = make_drafter(ids, ref) if make_drafter else None
        got, spec_tps, last = timed_tokens(
            stream_generate(model, tokenizer, ids, drafter=drafter, seed=seed + i, **decoding.kwargs()),
            lambda r: r.tokens,
        )
        same = got == ref if decoding.greedy else None
        res = PromptResult(i, len(got), plain_tps, spec_tps, last.tau, same)
        results.append(res)
        if progress:
            progress(res)
    return results


def summary(results: Sequence[PromptResult], groups: Sequence[str] | None = None) -> dict:
    """Medians over prompts: speedup (spec / plain tokens/s), tau, tokens/s; identity
    count; with ``groups`` (a label per prompt) also the medians per group."""
    out = {
        "prompts": len(results),
        "identical": sum(bool(r.identical) for r in results)
        if results and results[0].identical is not None
        else None,
        "median_speedup": statistics.median(r.speedup for r in results),
        "median_tau": statistics.median(r.tau for r in results),
        "median_plain_tps": statistics.median(r.plain_tps for r in results),
        "median_spec_tps": statistics.median(r.spec_tps for r in results),
        "results": [asdict(r) | {"speedup": r.speedup} for r in results],
    }
    if groups is not None:
        out["per_group"] = {}
        for g in dict.fromkeys(groups):
            rs = [r for r, gr in zip(results, groups) if gr == g]
            out["per_group"][g] = {k: v for k, v in summary(rs).items() if k != "results"}
        for r, g in zip(out["results"], groups):
            r["group"] = g
    return out


ORACLE_TREE = "chain:3"  # the oracle's default shape: tau is at most 4


def side_by_side(
    model,
    tokenizer,
    prompts: Sequence[str],
    decoding: Decoding,
    groups: Sequence[str] | None = None,
    oracle: bool = False,
    seed: int = 0,
    log: Callable[[str], None] = print,
    progress: Callable[[PromptResult], None] | None = None,
    ranks: Ranks | None = None,
) -> dict:
    """``mlx-stream bench``: the cost curve c(N) of this device, then :func:`compare`
    and its :func:`summary`. Over several ``ranks`` (:mod:`mlx_stream.distributed`) the
    prompts are split (prompt i on rank i mod size, seeded as on one rank) and every
    rank returns the summary of all of them; c(N) is rank 0's.

    Args:
        decoding: mlx-stream's settings; ``tree="auto"`` is resolved first
            (:func:`mlx_stream.speculation.auto_tree`) and reported with its expected bound.
        groups: a task-group label per prompt (medians per group).
        oracle: draft the target's own greedy output (:class:`~mlx_stream.drafters.oracle.OracleDrafter`,
            default tree ``chain:3``): the loop's ceiling; the result then carries
            ``oracle_ceiling``: tau / c(N), and the loop's overhead against it.
        log: receives one-line messages (the tree chosen, the cost curve).
        progress: called with each prompt's result.

    Returns:
        :func:`summary`'s dict plus ``tree``, ``tree_auto``, ``forward_cost``, with
        ``oracle`` ``oracle_ceiling``, and without a tree (nor the oracle) ``stored_tree``:
        the tree the heads store for this decoding (greedy or sampled), None for their default.

    Raises:
        ValueError: the oracle with sampling or with ``tree="auto"``, or a bad tree.
    """
    from .drafters.oracle import OracleDrafter
    from .speculation import auto_tree, is_auto, resolve_tree, stored_tree

    make, shape, chosen = None, None, None
    if oracle:
        if not decoding.greedy:
            raise ValueError("the oracle drafts the greedy output: use it with temp 0")
        if is_auto(decoding.tree):
            raise ValueError("tree 'auto' chooses among the heads' trees; give the oracle a tree shape")
        shape = resolve_tree(model, decoding.tree or ORACLE_TREE)
        vocab = model.args.vocab_size
        make = lambda ids, ref: OracleDrafter(len(ids), ref, shape, vocab)  # noqa: E731
    elif is_auto(decoding.tree):
        _, info = auto_tree(model)
        chosen = info["sizes"][info["best"]] | {"cached": info["cached"]}
        decoding = replace(decoding, tree=chosen["tree"])
        log(
            f"tree auto: {chosen['tree']} ({chosen['nodes']} drafted nodes): "
            f"expected tau {chosen['tau']:.2f}, "
            f"cost {chosen['cost']:.2f}, speedup bound x{chosen['speedup_bound']:.2f}"
            f"{' (cached choice)' if info['cached'] else ''}"
        )
    cost = forward_cost(model, sizes=tuple(sorted({1, 2, 4, 8, 16} | ({shape.size} if shape else set()))))
    log(
        "c(N) = "
        + ", ".join(f"{n}: {c:.2f}" for n, c in cost.items() if n != "t1_ms")
        + f"  (1-token forward {cost['t1_ms']:.1f} ms)"
    )
    ranks = ranks or Ranks()
    mine = compare(
        model,
        tokenizer,
        shard(prompts, ranks),
        decoding,
        make_drafter=make,
        progress=progress,
        seed=seed,
        indices=shard(range(len(prompts)), ranks),
    )
    if ranks.size > 1:
        rows = [r for part in ranks.gather([asdict(r) for r in mine]) for r in part]
        mine = sorted((PromptResult(**r) for r in rows), key=lambda r: r.prompt)
        cost = {k: float(v) for k, v in ranks.broadcast_object({str(k): v for k, v in cost.items()}).items()}
        cost = {int(k) if k.isdigit() else k: v for k, v in cost.items()}
    res = summary(mine, groups)
    res |= {"tree": decoding.tree, "tree_auto": chosen, "forward_cost": {str(k): v for k, v in cost.items()}}
    if decoding.tree is None and not oracle:  # the tree the heads store (greedy or sampled)
        res["stored_tree"] = stored_tree(model, sampled=not decoding.greedy)
    if oracle:
        # every rank-0 draft is accepted: tau / c(N) is what a loop without overhead would reach
        ceiling = res["median_tau"] / cost[shape.size]
        res["oracle_ceiling"] = {
            "tree_nodes": shape.size,
            "c": cost[shape.size],
            "ceiling": ceiling,
            "loop_overhead": 1 - res["median_speedup"] / ceiling,
        }
    return res


def decode_items(
    model,
    tokenizer,
    items: Sequence[dict],
    decoding: Decoding,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Greedy generation over ``items`` (``{"prompt", "group", "category"}``, through the
    chat template), drafting at every step (adaptive speculation off: tau measures the
    drafts, not the policy). Returns one row per item: the item's labels plus ``tokens``
    (made after the first), ``forward_passes`` (decoding passes) and ``skipped`` (True
    when the prompt and ``max_tokens`` do not fit in the context window)."""
    from .generate import stream_generate

    ctx = model.context_length
    kwargs = decoding.kwargs() | {"temp": 0.0, "adaptive": False}
    rows = []
    for it in items:
        ids = prompt_ids(tokenizer, it["prompt"])
        row = {
            "group": it["group"],
            "category": it["category"],
            "tokens": 0.0,
            "forward_passes": 0,
            "skipped": False,
        }
        if ctx is not None and len(ids) + decoding.max_tokens > ctx:
            row["skipped"] = True
        else:
            last = None
            for last in stream_generate(model, tokenizer, ids, **kwargs):  # noqa: B007
                pass
            row["tokens"], row["forward_passes"] = last.tau * last.forward_passes, last.forward_passes
        rows.append(row)
        if progress:
            progress(row)
    return rows


def pool_tau(rows: Sequence[dict]) -> dict:
    """tau pooled over :func:`decode_items` rows (tokens made after the first / decoding
    passes), overall (``all``), per task group (``group:...``) and per category
    (``category:...``), with prompt counts; skipped prompts are counted apart."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        if r["skipped"]:
            continue
        for key in ("all", f"group:{r['group']}", f"category:{r['category']}"):
            a = acc.setdefault(key, [0.0, 0.0, 0])
            a[0] += r["tokens"]
            a[1] += r["forward_passes"]
            a[2] += 1
    res = {k: {"tau": v[0] / max(v[1], 1), "prompts": v[2]} for k, v in sorted(acc.items())}
    res["skipped_too_long"] = {"tau": float("nan"), "prompts": sum(r["skipped"] for r in rows)}
    return res


def tau_by_category(
    model,
    tokenizer,
    items: Sequence[dict],
    decoding: Decoding,
    progress: Callable[[int, dict], None] | None = None,
) -> dict:
    """Greedy generation over ``items``; tau overall, per task group and per category
    (:func:`decode_items` then :func:`pool_tau`)."""
    done: list[dict] = []

    def step(row):
        done.append(row)
        if progress:
            progress(
                len(done), pool_tau(done)["all"] if any(not r["skipped"] for r in done) else {"tau": 0.0}
            )

    return pool_tau(decode_items(model, tokenizer, items, decoding, step))


def decode_items_over_ranks(
    model, tokenizer, items: Sequence[dict], decoding: Decoding, ranks: Ranks, progress=None
) -> list[dict]:
    """:func:`decode_items` with the items split over ``ranks`` (item i on rank i mod
    size; :mod:`mlx_stream.distributed`); every rank gets all rows, in item order."""
    return ranks.map(lambda mine: decode_items(model, tokenizer, mine, decoding, progress), items)


def _decode_rank(model_spec: str, heads, dtype: str, items, decoding: Decoding, path: str) -> None:
    from .distributed import connect
    from .loader import load

    ranks = connect()
    model, tokenizer = load(model_spec, heads=heads, dtype=dtype)
    rows = decode_items_over_ranks(model, tokenizer, items, decoding, ranks)
    if ranks.is_main:
        write_json(rows, path)


def decode_items_in_processes(
    model_spec: str, heads, dtype: str, items: Sequence[dict], decoding: Decoding, workers: int
) -> list[dict]:
    """:func:`decode_items_over_ranks` on ``workers`` ranks started on this machine
    (:func:`mlx_stream.distributed.launch_local`; each loads the model itself), rows
    back in item order. On a 2-core CPU two single-threaded ranks nearly double the
    throughput.

    Raises:
        RuntimeError: a rank failed.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/rows.json"
        launch_local(workers, _decode_rank, (model_spec, heads, dtype, list(items), decoding, path))
        return json.loads(Path(path).read_text())


def environment(dtype: str | None = None) -> dict:
    """What the numbers depend on: machine, OS, Python, MLX device, BLAS (Linux:
    OpenBLAS preloaded or the wheel's reference BLAS, and its thread count), dtype and
    package versions."""
    import os
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from .env import openblas_active

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    if platform.system() == "Darwin":
        blas = "Accelerate"
    elif openblas_active():
        blas = f"OpenBLAS (OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')})"
    else:
        blas = "reference BLAS (slow: see the README's CPU fast path)"
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpus": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "device": str(mx.default_device()),
        "blas": blas,
        "dtype": dtype,
        "versions": {n: ver(n) for n in ("mlx", "mlx-lm", "mlx-stream", "numpy")},
    }


def write_report(res: dict, out: str | Path) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``report.png`` (tau and speedup per task
    group, tokens/s distributions of both sides) for a :func:`summary` result extended
    with the run's settings; each file is written to a temporary name, then renamed.
    Returns the paths written."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def put(name: str, write) -> Path:
        return atomic_write(out / name, write)

    env = res.get("environment", {})
    ident = "n/a (sampled)" if res.get("identical") is None else f"{res['identical']}/{res['prompts']}"
    stored = f" (the heads' stored tree `{res['stored_tree']}`)" if res.get("stored_tree") else ""
    lines = [
        "# mlx-stream bench",
        "",
        f"- model `{res.get('model')}`, heads `{res.get('heads')}`, drafter `{res.get('drafter')}`, "
        f"tree `{res.get('tree')}`{stored}, dtype {res.get('dtype')}, max_tokens {res.get('max_tokens')}, "
        f"sampling {res.get('sampling') or 'greedy'}, prompt lookup {res.get('prompt_lookup', 'default')}",
        *(
            [
                f"- oracle ceiling: tau / c({res['oracle_ceiling']['tree_nodes']}) = "
                f"x{res['oracle_ceiling']['ceiling']:.2f}; measured x{res['median_speedup']:.2f}: "
                f"loop overhead {100 * res['oracle_ceiling']['loop_overhead']:.0f}%"
            ]
            if res.get("oracle_ceiling")
            else []
        ),
        *(
            [
                f"- tree auto chose `{res['tree_auto']['tree']}`: expected (heads only, held-out data) tau "
                f"{res['tree_auto']['tau']:.2f}, cost {res['tree_auto']['cost']:.2f}, speedup bound "
                f"x{res['tree_auto']['speedup_bound']:.2f}; "
                f"measured here: median tau {res['median_tau']:.2f}, "
                f"median speedup x{res['median_speedup']:.2f}"
            ]
            if res.get("tree_auto")
            else []
        ),
        f"- machine: {env.get('machine')}, {env.get('cpus')} CPUs, {env.get('os')}; "
        f"device {env.get('device')}; "
        f"BLAS {env.get('blas')}; versions {env.get('versions')}",
        f"- command: `{res.get('command', '')}`",
        "",
        "| | prompts | speedup (median) | tau (median) | plain tok/s | mlx-stream tok/s | identical |",
        "|---|---|---|---|---|---|---|",
        f"| all | {res['prompts']} | {res['median_speedup']:.2f}x | {res['median_tau']:.2f} | "
        f"{res['median_plain_tps']:.1f} | {res['median_spec_tps']:.1f} | {ident} |",
    ]
    for g, v in res.get("per_group", {}).items():
        gi = "n/a" if v.get("identical") is None else f"{v['identical']}/{v['prompts']}"
        lines.append(
            f"| {g} | {v['prompts']} | {v['median_speedup']:.2f}x | {v['median_tau']:.2f} | "
            f"{v['median_plain_tps']:.1f} | {v['median_spec_tps']:.1f} | {gi} |"
        )
    if "forward_cost" in res:
        lines += [
            "",
            "c(N), an N-token forward relative to a 1-token one: "
            + ", ".join(f"{k}: {v:.2f}" for k, v in res["forward_cost"].items() if k != "t1_ms"),
        ]
    lines += ["", "![tau and speedup](report.png)", ""]
    written = [
        put("report.json", lambda p: p.write_text(json.dumps(res, indent=2))),
        put("report.md", lambda p: p.write_text("\n".join(lines))),
    ]

    groups = res.get("per_group") or {"all": res}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(groups)
    x = range(len(names))
    a1.bar([i - 0.2 for i in x], [groups[g]["median_tau"] for g in names], 0.4, label="tau")
    a1.bar([i + 0.2 for i in x], [groups[g]["median_speedup"] for g in names], 0.4, label="speedup")
    a1.axhline(1.0, color="grey", lw=0.8)
    a1.set_xticks(list(x), names, rotation=30, ha="right")
    a1.set_title("median per task group")
    a1.legend()
    plain = [r["plain_tps"] for r in res["results"]]
    spec = [r["spec_tps"] for r in res["results"]]
    a2.hist([plain, spec], bins=15, label=["plain mlx-lm", "mlx-stream"])
    a2.set_xlabel("generation tokens/s")
    a2.set_title("per prompt")
    a2.legend()
    fig.tight_layout()
    written.append(put("report.png", lambda p: fig.savefig(p, format="png", dpi=110)))
    plt.close(fig)
    return written
