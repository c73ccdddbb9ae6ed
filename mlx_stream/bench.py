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
    identical: bool

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
    cached context of ``context`` tokens (median of ``repeats``)."""
    from .cache import make_tree_cache, trim_cache
    from .tree import chain

    fam, bb = model.family, model.backbone
    cache = make_tree_cache(bb)
    fam.prefill_hidden(bb, mx.zeros((context,), dtype=mx.int32), cache)
    times = {}
    for n in sizes:
        t = chain(n - 1)
        mask = mx.concatenate([mx.ones((n, context), dtype=mx.bool_), mx.array(t.mask)], axis=1) if n > 1 else None
        runs = []
        for _ in range(repeats + 1):
            tic = time.perf_counter()
            mx.eval(fam.project(bb, fam.tree_hidden(bb, mx.zeros((n,), dtype=mx.int32),
                                                    mx.array(context + t.depths), mask, cache)))
            runs.append(time.perf_counter() - tic)
            trim_cache(cache, context)
        times[n] = statistics.median(runs[1:])
    return {n: times[n] / times[sizes[0]] for n in sizes} | {"t1_ms": times[sizes[0]] * 1e3}


def compare(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_tokens: int = 128,
    make_drafter: Callable | None = None,
    tree=None,
    progress: Callable[[PromptResult], None] | None = None,
) -> list[PromptResult]:
    """Greedy decoding of each prompt (through the chat template) by plain
    ``mlx_lm.stream_generate`` and by :func:`mlx_stream.stream_generate`, interleaved.

    Args:
        make_drafter: ``f(prompt_ids, reference_tokens) -> Drafter`` (e.g. the
            oracle); ``None`` drafts with the model's heads and ``tree``.
    """
    import mlx_lm

    from .generate import stream_generate

    def chat_ids(p):
        return tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)

    # warm-up: both paths, so one-time costs hit neither measurement
    warm = chat_ids("Hello")
    for _ in mlx_lm.stream_generate(model, tokenizer, mx.array(warm), max_tokens=8):
        pass
    for _ in stream_generate(model, tokenizer, warm, max_tokens=8, tree=tree):
        pass
    results = []
    for i, p in enumerate(prompts):
        ids = chat_ids(p)
        ref, plain_tps = [], 0.0
        for r in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens):
            if r.token in tokenizer.eos_token_ids:
                break
            ref.append(r.token)
            plain_tps = r.generation_tps
        drafter = make_drafter(ids, ref) if make_drafter else None
        got, last = [], None
        for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, tree=tree, drafter=drafter):
            got.extend(last.tokens)
        res = PromptResult(i, len(got), plain_tps, last.generation_tps, last.tau, got == ref)
        results.append(res)
        if progress:
            progress(res)
    return results


def summary(results: Sequence[PromptResult], groups: Sequence[str] | None = None) -> dict:
    """Medians over prompts: speedup (spec / plain tokens/s), tau, tokens/s; identity
    count; with ``groups`` (a label per prompt) also the medians per group."""
    out = {
        "prompts": len(results),
        "identical": sum(r.identical for r in results),
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


def tau_by_category(model, tokenizer, items: Sequence[dict], max_tokens: int = 128, tree=None,
                    progress: Callable[[int, dict], None] | None = None) -> dict:
    """Greedy generation over ``items`` (through the chat template); tau = tokens
    produced after the first / decoding forward passes, pooled overall, per task
    group and per category. Prompts that do not fit in the context window with
    ``max_tokens`` are skipped and counted."""
    from .generate import stream_generate

    acc: dict[str, list[float]] = {}
    ctx = model.context_length
    skipped = 0
    for i, it in enumerate(items):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": it["prompt"]}], add_generation_prompt=True)
        if ctx is not None and len(ids) + max_tokens > ctx:
            skipped += 1  # does not fit in the context window
            continue
        last = None
        for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, tree=tree):
            pass
        made = last.tau * last.forward_passes
        for key in ("all", f"group:{it['group']}", f"category:{it['category']}"):
            a = acc.setdefault(key, [0.0, 0.0, 0])
            a[0] += made
            a[1] += last.forward_passes
            a[2] += 1
        if progress:
            progress(i + 1, {"tau": acc["all"][0] / max(acc["all"][1], 1)})
    res = {k: {"tau": v[0] / max(v[1], 1), "prompts": v[2]} for k, v in sorted(acc.items())}
    res["skipped_too_long"] = {"tau": float("nan"), "prompts": skipped}
    return res
