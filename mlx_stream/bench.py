"""Side-by-side measurement against plain mlx-lm (same model object, same process).

Prompts are run interleaved (mlx-lm, then mlx-stream, per prompt) after a warm-up,
so machine drift hits both; ratios are per prompt and summarised by the median.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx


@dataclass
class PromptResult:
    """One prompt's side-by-side result. Speeds are generation tokens/s (prefill excluded)."""

    prompt: int
    tokens: int
    plain_tps: float
    spec_tps: float
    tau: float
    identical: bool | None  # None when sampling (outputs differ by chance)

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a jsonl file: the ``prompt`` field, or the first of ``turns``
    (Spec-Bench's format), or the first user message of ``messages``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON or has none of those fields (line named).
    """
    from .train.data import read_jsonl

    out = []
    for n, row in enumerate(read_jsonl(path), 1):
        if "prompt" in row:
            out.append(row["prompt"])
        elif row.get("turns"):
            out.append(row["turns"][0])
        elif row.get("messages"):
            out.append(next(m["content"] for m in row["messages"] if m["role"] == "user"))
        else:
            raise ValueError(f"{path}: row {n}: expected a 'prompt', 'turns' or 'messages' field")
    return out[:limit] if limit else out


def forward_cost(model, sizes: Sequence[int] = (1, 2, 4, 8, 16), context: int = 256, repeats: int = 10) -> dict:
    """c(N): the time of an N-token tree forward relative to a 1-token forward, at a
    cached context of ``context`` tokens.

    The sizes are timed round-robin (each repeat runs every size once, so drift on a
    shared machine hits all sizes alike), each c(N) is the median of ``repeats``, and
    the curve is made non-decreasing (a larger forward never costs less; noise can
    make it look so). Also returns ``t1_ms``, the 1-token forward's median time.
    """
    from .cache import make_tree_cache, trim_cache
    from .tree import chain

    fam, bb = model.family, model.backbone
    cache = make_tree_cache(bb)
    fam.prefill_hidden(bb, mx.zeros((context,), dtype=mx.int32), cache)
    sizes = sorted(sizes)
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            t = chain(n - 1)
            mask = mx.concatenate([mx.ones((n, context), dtype=mx.bool_), mx.array(t.mask)], axis=1) if n > 1 else None
            tic = time.perf_counter()
            mx.eval(fam.project(bb, fam.tree_hidden(bb, mx.zeros((n,), dtype=mx.int32),
                                                    mx.array(context + t.depths), mask, cache)))
            if r:  # the first round warms up
                runs[n].append(time.perf_counter() - tic)
            trim_cache(cache, context)
    times, worst = {}, 0.0
    for n in sizes:
        worst = max(worst, statistics.median(runs[n]))
        times[n] = worst
    return {n: times[n] / times[sizes[0]] for n in sizes} | {"t1_ms": times[sizes[0]] * 1e3}


def draft_times(model, trees: Sequence, context: int = 256, repeats: int = 10) -> list[float]:
    """Median milliseconds for ``model``'s heads to draft each tree of ``trees`` once
    (a :class:`~mlx_stream.drafters.HeadsDrafter` at a cached context of ``context``
    tokens, prefilled once for all trees), evaluation included."""
    from .drafters import HeadsDrafter

    fam, bb = model.family, model.backbone
    capture = HeadsDrafter(model, trees[0]).capture if trees else None
    ids = mx.arange(1, context + 1, dtype=mx.int32) % bb.args.vocab_size
    cache = model.make_cache()
    out = fam.prefill_hidden(bb, ids, cache, capture=capture)
    hidden, mid = (out[0][-1], out[1][-1]) if capture is not None else (out[-1], None)
    tokens = ids.tolist() + [1]
    result = []
    for tree in trees:
        drafter = HeadsDrafter(model, tree)
        runs = []
        for _ in range(repeats + 1):
            tic = time.perf_counter()
            if mid is None:
                mx.eval(drafter.draft(hidden, tokens))
            else:
                mx.eval(drafter.draft(hidden, tokens, mid=mid, cache=cache))
            runs.append(time.perf_counter() - tic)
        result.append(1e3 * statistics.median(runs[1:]))
    return result


def compare(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_tokens: int = 128,
    make_drafter: Callable | None = None,
    tree=None,
    progress: Callable[[PromptResult], None] | None = None,
    sampling: dict | None = None,
    seed: int = 0,
    prompt_lookup: int | None = None,
) -> list[PromptResult]:
    """Decoding of each prompt (through the chat template) by plain
    ``mlx_lm.stream_generate`` and by :func:`mlx_stream.stream_generate`, interleaved.

    Args:
        make_drafter: ``f(prompt_ids, reference_tokens) -> Drafter`` (e.g. the
            oracle); ``None`` drafts with the model's heads and ``tree``.
        sampling: ``temp``, ``top_p``, ``top_k``, ``min_p`` (greedy when absent or
            ``temp == 0``): plain mlx-lm samples with ``make_sampler`` of the same
            settings, seeded with ``seed + i`` for prompt i, as is mlx-stream.
            Identity is checked only when greedy.
        prompt_lookup: as :func:`mlx_stream.stream_generate` (None: its default).
    """
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from .generate import stream_generate

    sampling = dict(sampling or {})
    greedy = not sampling.get("temp")
    sampler = None if greedy else make_sampler(
        temp=sampling["temp"], top_p=sampling.get("top_p", 1.0), min_p=sampling.get("min_p", 0.0),
        top_k=sampling.get("top_k", 0))

    from .train.data import prompt_ids

    def chat_ids(p):
        return prompt_ids(tokenizer, p)

    # warm-up: both paths, so one-time costs hit neither measurement
    warm = chat_ids("Hello")
    for _ in mlx_lm.stream_generate(model, tokenizer, mx.array(warm), max_tokens=8):
        pass
    for _ in stream_generate(model, tokenizer, warm, max_tokens=8, tree=tree, prompt_lookup=prompt_lookup):
        pass
    results = []
    for i, p in enumerate(prompts):
        ids = chat_ids(p)
        ref, plain_tps = [], 0.0
        mx.random.seed(seed + i)
        for r in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens, sampler=sampler):
            if r.token in tokenizer.eos_token_ids:
                break
            ref.append(r.token)
            plain_tps = r.generation_tps
        drafter = make_drafter(ids, ref) if make_drafter else None
        got, last = [], None
        for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, tree=tree, drafter=drafter,
                                    seed=seed + i, prompt_lookup=prompt_lookup, **sampling):
            got.extend(last.tokens)
        res = PromptResult(i, len(got), plain_tps, last.generation_tps, last.tau, got == ref if greedy else None)
        results.append(res)
        if progress:
            progress(res)
    return results


def summary(results: Sequence[PromptResult], groups: Sequence[str] | None = None) -> dict:
    """Medians over prompts: speedup (spec / plain tokens/s), tau, tokens/s; identity
    count; with ``groups`` (a label per prompt) also the medians per group."""
    out = {
        "prompts": len(results),
        "identical": sum(bool(r.identical) for r in results) if results and results[0].identical is not None
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


MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def task_group(category: str) -> str:
    """Spec-Bench's six task groups: the eight MT-bench categories form ``mt-bench``."""
    return "mt-bench" if category in MT_BENCH else category


def load_spec_bench(path: str | Path, per_group: int | None = None) -> list[dict]:
    """Spec-Bench questions (``question.jsonl``): ``{"category", "group", "prompt"}``
    with the first turn as the prompt; ``per_group`` keeps the first N of each task
    group (file order).

    Raises:
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Spec-Bench question.jsonl not found")
    out, seen = [], {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        group = task_group(row["category"])
        if per_group is not None and seen.get(group, 0) >= per_group:
            continue
        seen[group] = seen.get(group, 0) + 1
        out.append({"category": row["category"], "group": group, "prompt": row["turns"][0]})
    return out


def decode_items(model, tokenizer, items: Sequence[dict], max_tokens: int = 128, tree=None,
                 progress: Callable[[dict], None] | None = None, prompt_lookup: int | None = None) -> list[dict]:
    """Greedy generation over ``items`` (``{"prompt", "group", "category"}``, through the
    chat template), drafting at every step (adaptive speculation off: tau measures the
    drafts, not the policy). Returns one row per item: the item's labels plus ``tokens``
    (made after the first), ``forward_passes`` (decoding passes) and ``skipped`` (True
    when the prompt and ``max_tokens`` do not fit in the context window)."""
    from .generate import stream_generate
    from .train.data import prompt_ids

    ctx = model.context_length
    rows = []
    for it in items:
        ids = prompt_ids(tokenizer, it["prompt"])
        row = {"group": it["group"], "category": it["category"], "tokens": 0.0, "forward_passes": 0, "skipped": False}
        if ctx is not None and len(ids) + max_tokens > ctx:
            row["skipped"] = True
        else:
            last = None
            for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, tree=tree, adaptive=False,
                                        prompt_lookup=prompt_lookup):
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


def tau_by_category(model, tokenizer, items: Sequence[dict], max_tokens: int = 128, tree=None,
                    progress: Callable[[int, dict], None] | None = None, prompt_lookup: int | None = None) -> dict:
    """Greedy generation over ``items``; tau overall, per task group and per category
    (:func:`decode_items` then :func:`pool_tau`)."""
    done: list[dict] = []

    def step(row):
        done.append(row)
        if progress:
            progress(len(done), pool_tau(done)["all"] if any(not r["skipped"] for r in done) else {"tau": 0.0})

    return pool_tau(decode_items(model, tokenizer, items, max_tokens, tree, step, prompt_lookup))


def _decode_worker(model_spec: str, heads, dtype: str, items, max_tokens: int, tree, path: str,
                   prompt_lookup: int | None) -> None:
    from .loader import load

    model, tokenizer = load(model_spec, heads=heads, dtype=dtype)
    rows = decode_items(model, tokenizer, items, max_tokens, tree, prompt_lookup=prompt_lookup)
    Path(path).write_text(json.dumps(rows))


def decode_items_in_processes(model_spec: str, heads, dtype: str, items: Sequence[dict], max_tokens: int,
                              tree, workers: int, prompt_lookup: int | None = None) -> list[dict]:
    """:func:`decode_items` split over ``workers`` spawned processes (item i goes to
    worker i mod workers; each loads the model itself), rows back in item order. On a
    2-core CPU two single-threaded processes nearly double the throughput.

    Raises:
        RuntimeError: a worker failed.
    """
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [f"{tmp}/{w}.json" for w in range(workers)]
        procs = [ctx.Process(target=_decode_worker, daemon=True,
                             args=(model_spec, heads, dtype, list(items[w::workers]), max_tokens, tree, paths[w],
                                   prompt_lookup))
                 for w in range(workers)]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
        if any(pr.exitcode != 0 for pr in procs):
            raise RuntimeError("a decoding worker failed (its error is printed above)")
        parts = [json.loads(Path(p).read_text()) for p in paths]
    return [parts[i % workers][i // workers] for i in range(len(items))]


def environment(dtype: str | None = None) -> dict:
    """What the numbers depend on: machine, OS, Python, MLX device, BLAS (Linux:
    OpenBLAS preloaded or the wheel's reference BLAS, and its thread count), dtype and
    package versions."""
    import os
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from .env import openblas_loaded

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    if platform.system() == "Darwin":
        blas = "Accelerate"
    elif openblas_loaded():
        blas = f"OpenBLAS (OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')})"
    else:
        blas = "reference BLAS (slow: see the README's CPU fast path)"
    return {
        "machine": platform.machine(), "processor": platform.processor() or None, "cpus": os.cpu_count(),
        "os": platform.platform(), "python": platform.python_version(), "device": str(mx.default_device()),
        "blas": blas, "dtype": dtype,
        "versions": {n: ver(n) for n in ("mlx", "mlx-lm", "mlx-stream", "numpy")},
    }


def write_json(obj, path: str | Path) -> Path:
    """Write ``obj`` as indented JSON to ``path`` through a temporary file and a rename,
    so a reader never sees half a file."""
    import os

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
    return path


def write_report(res: dict, out: str | Path) -> list[Path]:
    """Write ``report.json``, ``report.md`` and ``report.png`` (tau and speedup per task
    group, tokens/s distributions of both sides) for a :func:`summary` result extended
    with the run's settings; each file is written to a temporary name, then renamed.
    Returns the paths written."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def put(name: str, write) -> Path:
        path = out / name
        tmp = out / f".{name}.tmp"
        write(tmp)
        os.replace(tmp, path)
        return path

    env = res.get("environment", {})
    ident = "n/a (sampled)" if res.get("identical") is None else f"{res['identical']}/{res['prompts']}"
    lines = [
        "# mlx-stream bench", "",
        f"- model `{res.get('model')}`, heads `{res.get('heads')}`, drafter `{res.get('drafter')}`, "
        f"tree `{res.get('tree')}`, dtype {res.get('dtype')}, max_tokens {res.get('max_tokens')}, "
        f"sampling {res.get('sampling') or 'greedy'}, prompt lookup {res.get('prompt_lookup', 'default')}",
        *([f"- oracle ceiling: tau / c({res['oracle_ceiling']['tree_nodes']}) = x{res['oracle_ceiling']['ceiling']:.2f}; "
           f"measured x{res['median_speedup']:.2f}: loop overhead {100 * res['oracle_ceiling']['loop_overhead']:.0f}%"]
          if res.get("oracle_ceiling") else []),
        *([f"- tree auto chose `{res['tree_auto']['tree']}`: expected (heads only, held-out data) tau "
           f"{res['tree_auto']['tau']:.2f}, cost {res['tree_auto']['cost']:.2f}, speedup bound "
           f"x{res['tree_auto']['speedup_bound']:.2f}; measured here: median tau {res['median_tau']:.2f}, "
           f"median speedup x{res['median_speedup']:.2f}"] if res.get("tree_auto") else []),
        f"- machine: {env.get('machine')}, {env.get('cpus')} CPUs, {env.get('os')}; device {env.get('device')}; "
        f"BLAS {env.get('blas')}; versions {env.get('versions')}",
        f"- command: `{res.get('command', '')}`", "",
        "| | prompts | speedup (median) | tau (median) | plain tok/s | mlx-stream tok/s | identical |",
        "|---|---|---|---|---|---|---|",
        f"| all | {res['prompts']} | {res['median_speedup']:.2f}x | {res['median_tau']:.2f} | "
        f"{res['median_plain_tps']:.1f} | {res['median_spec_tps']:.1f} | {ident} |",
    ]
    for g, v in res.get("per_group", {}).items():
        gi = "n/a" if v.get("identical") is None else f"{v['identical']}/{v['prompts']}"
        lines.append(f"| {g} | {v['prompts']} | {v['median_speedup']:.2f}x | {v['median_tau']:.2f} | "
                     f"{v['median_plain_tps']:.1f} | {v['median_spec_tps']:.1f} | {gi} |")
    if "forward_cost" in res:
        lines += ["", "c(N), an N-token forward relative to a 1-token one: "
                  + ", ".join(f"{k}: {v:.2f}" for k, v in res["forward_cost"].items() if k != "t1_ms")]
    lines += ["", "![tau and speedup](report.png)", ""]
    written = [put("report.json", lambda p: p.write_text(json.dumps(res, indent=2))),
               put("report.md", lambda p: p.write_text("\n".join(lines)))]

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
