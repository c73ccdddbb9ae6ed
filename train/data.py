"""Training data for stream heads.

Three sources, all saved as jsonl rows ``{"prompt": str, "completion": str}``:

* the user's jsonl in mlx-lm's formats (``{"messages": [...]}``,
  ``{"prompt", "completion"}``, ``{"text"}``);
* self-distillation (the default): the frozen backbone writes the completions
  itself with greedy batched generation, so the heads learn the distribution they
  will be verified against (Medusa-2's self-distillation, Cai et al. 2024, sec. 2.3.2);
* self-synthesised prompts when the user has none: user turns sampled from the
  chat template's user-turn prefix (Magpie, Xu et al. 2024), deduplicated.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from mlx_stream.files import atomic_write
from mlx_stream.prompts import prompt_ids, read_jsonl  # noqa: F401 (re-exported)

_SENTINEL = "\u2063MLXSTREAM\u2063"


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows atomically (temporary file beside ``path``, then rename)."""

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    return atomic_write(path, write)


def to_example(row: dict, where: str = "row") -> dict:
    """Normalise one row of mlx-lm's formats to ``{"prompt": ..., "completion": ...}``
    (``messages`` keeps its last assistant turn as the completion and the turns
    before it as the prompt, as a list of messages; ``text`` has an empty prompt).

    Raises:
        ValueError: a row of none of the formats.
    """
    if "messages" in row:
        msgs = row["messages"]
        if not msgs or not isinstance(msgs, list):
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        if msgs[-1].get("role") == "assistant":
            return {"prompt": msgs[:-1], "completion": msgs[-1]["content"]}
        return {"prompt": msgs, "completion": None}
    if "prompt" in row:
        return {"prompt": row["prompt"], "completion": row.get("completion")}
    if "text" in row:
        return {"prompt": "", "completion": row["text"]}
    raise ValueError(f"{where}: expected 'messages', 'prompt'/'completion' or 'text'")


def split(rows: Sequence[dict], valid_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle with ``seed`` and split off ``valid_fraction`` (at least one row each
    when there are two or more)."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_valid = min(max(1, round(len(rows) * valid_fraction)), len(rows) - 1) if len(rows) > 1 else 0
    return rows[n_valid:], rows[:n_valid]


def user_prefix(tokenizer) -> str:
    """The chat template's text before a user turn's content (Magpie's query prefix).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "this model has no chat template, so prompts cannot be self-synthesised: "
            "give prompts with --data (jsonl)"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    return text[: text.index(_SENTINEL)]


def synthesize_prompts(
    model,
    tokenizer,
    n: int,
    seed: int = 0,
    max_tokens: int = 96,
    temp: float = 1.0,
    top_p: float = 0.95,
    batch_size: int = 64,
    exclude: Iterable[str] = (),
    log=None,
) -> list[str]:
    """Sample ``n`` distinct user prompts from the chat template's user prefix
    (Magpie, Xu et al. 2024, sec. 2.1): the aligned model, shown only the start of a
    user turn, writes a plausible user query. Queries that do not end within
    ``max_tokens``, are shorter than 3 words, or repeat one already kept are dropped.

    Args:
        model: a :class:`mlx_stream.model.SpeculativeModel`.
        n: prompts wanted (fewer come back if too many samples are dropped).
        seed: MLX's global seed is set from it, so the same call gives the same prompts,
            and the first m prompts of a call for n > m are those of a call for m.
        log: called with a progress line about once a minute.

    Returns:
        The prompts, in the order sampled.
    """
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from .generation import generate_batch

    prefix = tokenizer.encode(user_prefix(tokenizer), add_special_tokens=False)
    sampler = make_sampler(temp=temp, top_p=top_p)
    eos = set(tokenizer.eos_token_ids)
    seen = {p.strip().lower() for p in exclude}
    out: list[str] = []
    mx.random.seed(seed)
    tic, last = time.perf_counter(), 0.0
    rounds = 0
    while len(out) < n and rounds < 4:
        rounds += 1
        want = max(2 * (n - len(out)), batch_size)
        # completion order is deterministic too; stop as soon as enough are kept
        for _, g in generate_batch(
            model, [prefix] * want, max_tokens, sampler=sampler, eos_ids=eos, batch_size=batch_size
        ):
            q = tokenizer.decode([t for t in g.tokens if t not in eos]).strip()
            if g.finish_reason != "stop" or len(q.split()) < 3 or q.lower() in seen:
                continue
            seen.add(q.lower())
            out.append(q)
            if log and (time.perf_counter() - tic - last > 60 or len(out) == n):
                last = time.perf_counter() - tic
                log(f"synthesised {len(out)}/{n} prompts in {last:.0f}s")
            if len(out) == n:
                break
    return out


def self_distill(
    model, tokenizer, prompts: Sequence, max_tokens: int = 256, batch_size: int = 32
) -> list[dict]:
    """Greedy completions of ``prompts`` by the frozen backbone (continuous batching).

    Returns rows ``{"prompt": prompt, "completion": text}`` in the order of ``prompts``.
    (The training pipeline keeps the hidden states of the same passes; see
    :func:`mlx_stream.train.pipeline.build_split`.)
    """
    from .generation import generate_batch

    eos = set(tokenizer.eos_token_ids)
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    done = dict(generate_batch(model, ids, max_tokens, eos_ids=eos, batch_size=batch_size))
    return [
        {"prompt": p, "completion": tokenizer.decode([t for t in done[i].tokens if t not in eos])}
        for i, p in enumerate(prompts)
    ]
