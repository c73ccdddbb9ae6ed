"""Prompt files: the evaluation sets shipped with the package and the bench's selection."""

import pytest

from mlx_stream.prompts import BUILTIN_PROMPTS, SPEC_BENCH, load_spec_bench, select_prompts


def test_spec_bench_ships_with_its_license():
    assert (SPEC_BENCH.parent / "LICENSE").read_text().startswith("Apache License")
    items = load_spec_bench()
    assert len(items) == 480 and len({it["category"] for it in items}) == 13
    assert {it["group"] for it in items} == {
        "mt-bench",
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
    }
    two = load_spec_bench(per_group=2)
    assert len(two) == 12 and all(
        sum(it["group"] == g for it in two) == 2 for g in {it["group"] for it in two}
    )


def test_select_prompts():
    texts, groups = select_prompts("spec-bench", per_group=1)
    assert len(texts) == len(groups) == 6
    texts, groups = select_prompts("builtin", limit=3)
    assert len(texts) == 3 and groups is None and texts == select_prompts(str(BUILTIN_PROMPTS), limit=3)[0]
    for kw in ({"limit": 0}, {"per_group": 0}):
        with pytest.raises(ValueError, match=">= 1"):
            select_prompts("spec-bench", **kw)
    with pytest.raises(FileNotFoundError, match="'builtin' or 'spec-bench'"):
        select_prompts("no-such-file.jsonl")
