"""Task prompts derived from the backbone's own answers (train/tasks.py) and `mlx-stream tasks`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_stream.train.tasks import KINDS, LANGUAGES, derive_task_prompts

EXE = str(Path(sys.executable).parent / "mlx-stream")
ANSWER = (
    "Lighthouses guide ships along dangerous coasts at night. Their lamps turn so that sailors "
    "can tell one light from another by its rhythm. Today most are automatic, but some keepers "
    "still live beside them and log the weather every few hours, as their predecessors did for "
    "two centuries before radio and satellite navigation made the towers less important. "
    "Many towers are now museums that visitors can climb on summer weekends."
)
ROWS = [{"prompt": f"Question {i}: what do lighthouses do?", "completion": ANSWER} for i in range(60)]


def test_each_kind_uses_the_answer_and_the_question():
    for kind in ("summarize", "passage-qa", "translate"):
        out = derive_task_prompts(ROWS, seed=0, kinds=[kind])
        assert len(out) == len(ROWS) and {r["task"] for r in out} == {kind}
        for r, row in zip(out, ROWS):
            if kind == "translate":
                assert "Lighthouses guide ships along dangerous coasts at night." in r["prompt"]
                assert any(lang in r["prompt"] for lang in LANGUAGES)
                assert "museums" not in r["prompt"]  # at most 60 words of whole sentences
            else:
                assert ANSWER in r["prompt"]
            if kind == "passage-qa":
                assert row["prompt"] in r["prompt"]


def test_mixed_kinds_are_drawn_reproducibly():
    a = derive_task_prompts(ROWS, seed=3, kinds=KINDS)
    assert a == derive_task_prompts(ROWS, seed=3, kinds=KINDS)
    assert a != derive_task_prompts(ROWS, seed=4, kinds=KINDS)
    assert {r["task"] for r in a} == {"summarize", "passage-qa", "translate"}


def test_back_translation_of_translation_answers():
    rows = [
        {
            "prompt": "Translate English to German: The house is red.",
            "completion": "Das Haus ist rot und alt.",
        },
        {
            "prompt": "Translate into French: Hello there my friend.",
            "completion": "Bonjour mon ami, comment vas-tu?",
        },
        {"prompt": "Translate into French: Hi.", "completion": "Salut."},  # too short to use
    ]
    out = derive_task_prompts(rows, kinds=["back-translate"])
    assert [r["prompt"] for r in out] == [
        "Translate German to English: Das Haus ist rot und alt.",
        "Translate French to English: Bonjour mon ami, comment vas-tu?",
    ]
    with pytest.raises(ValueError, match="no row"):  # translation answers give no other task
        derive_task_prompts(rows, kinds=["summarize"])


def test_unusable_rows_and_unknown_kinds():
    rows = [{"prompt": "Hi", "completion": "Too short."}, {"prompt": "x", "completion": None}, ROWS[0]]
    assert len(derive_task_prompts(rows, kinds=["summarize"])) == 1
    with pytest.raises(ValueError, match="unknown task kind"):
        derive_task_prompts(ROWS, kinds=["poetry"])
    with pytest.raises(ValueError, match="no row"):
        derive_task_prompts(rows[:2])


def test_cli_writes_prompts_for_train_data(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "tasks.jsonl"
    r = subprocess.run(
        [EXE, "tasks", str(src), "--out", str(out), "-n", "10", "--seed", "1"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and all(set(row) == {"prompt", "task"} for row in rows)
    assert f"{out}: 10 prompts" in r.stdout
    bad = subprocess.run(
        [EXE, "tasks", str(src), "--out", str(out), "--kinds", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown task kind" in bad.stderr
    assert len(out.read_text().splitlines()) == 10  # the earlier file is untouched
