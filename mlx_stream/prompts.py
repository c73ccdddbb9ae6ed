"""Prompt files: jsonl reading, the evaluation sets shipped with the package, and
prompts through the chat template."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
BUILTIN_PROMPTS = DATA / "prompts.jsonl"  # 20 short chat prompts (tests, quick benches)
SPEC_BENCH = DATA / "spec_bench" / "question.jsonl"  # Spec-Bench (Xia et al. 2024), Apache-2.0
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a jsonl file (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object (file and line named).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    rows = []
    with path.open(encoding="utf-8") as f:
        lines = enumerate(f, 1)
        while True:
            try:
                n, line = next(lines)
            except StopIteration:
                break
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object per line")
            rows.append(row)
    return rows


def prompt_ids(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt through the chat template (a string is one user turn, a
    list is ``{"role", "content"}`` messages; an empty string means no template: raw
    text). A tokenizer without a chat template (a base model such as OPT) encodes the
    text as it is (turns joined by newlines)."""
    if prompt == "":
        return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None) is None:
        return tokenizer.encode("\n".join(m["content"] for m in msgs))
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a jsonl file: the ``prompt`` field, or the first of ``turns``
    (Spec-Bench's format), or the first user message of ``messages``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON or has none of those fields (line named).
    """
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


def task_group(category: str) -> str:
    """Spec-Bench's six task groups: the eight MT-bench categories form ``mt-bench``."""
    return "mt-bench" if category in MT_BENCH else category


def load_spec_bench(path: str | Path | None = None, per_group: int | None = None) -> list[dict]:
    """Spec-Bench questions: ``{"category", "group", "prompt"}`` with the first turn as
    the prompt; ``per_group`` keeps the first N of each task group (file order).

    Args:
        path: a Spec-Bench ``question.jsonl``; None: the copy shipped with the package
            (:data:`SPEC_BENCH`, 480 questions in 13 categories).
        per_group: the first N questions of each task group, or all.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON or lacks ``category``/``turns``.
    """
    path = SPEC_BENCH if path is None else Path(path)
    out, seen = [], {}
    for n, row in enumerate(read_jsonl(path), 1):
        if "category" not in row or not row.get("turns"):
            raise ValueError(f"{path}: row {n}: expected Spec-Bench's 'category' and 'turns' fields")
        group = task_group(row["category"])
        if per_group is not None and seen.get(group, 0) >= per_group:
            continue
        seen[group] = seen.get(group, 0) + 1
        out.append({"category": row["category"], "group": group, "prompt": row["turns"][0]})
    return out


def select_prompts(
    spec: str, limit: int | None = None, per_group: int | None = None
) -> tuple[list[str], list[str] | None]:
    """The prompts a bench runs, and their task groups where known.

    Args:
        spec: ``"builtin"`` (:data:`BUILTIN_PROMPTS`, the first ``limit``),
            ``"spec-bench"`` (the shipped Spec-Bench, ``per_group`` of each task group),
            or a jsonl file (:func:`load_prompts`, the first ``limit``).

    Returns:
        ``(prompts, groups)``: ``groups`` is a task group per prompt for Spec-Bench,
        else ``None``.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_prompts` / :func:`load_spec_bench`;
            ``limit`` or ``per_group`` below 1, or no prompt selected.
    """
    for name, n in (("limit", limit), ("per_group", per_group)):
        if n is not None and n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    if spec == "spec-bench":
        items = load_spec_bench(None, per_group)
        texts, groups = [it["prompt"] for it in items], [it["group"] for it in items]
    else:
        try:
            texts, groups = load_prompts(BUILTIN_PROMPTS if spec == "builtin" else Path(spec), limit), None
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}; --prompts takes a jsonl file, 'builtin' or 'spec-bench'") from e
    if not texts:
        raise ValueError(f"{spec}: no prompts selected")
    return texts, groups
