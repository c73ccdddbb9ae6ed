"""Task prompts derived from the backbone's own texts.

Magpie prompts (``data.synthesize_prompts``) are short chat queries, so heads trained
only on them rarely see what long-context tasks look like: summarising a document,
answering a question about a passage, translating. Those tasks are most of what
people ask an assistant (and five of Spec-Bench's six task groups), and the heads'
acceptance there was far below their held-out Magpie accuracy.

:func:`derive_task_prompts` re-poses finished self-distilled rows ``{"prompt",
"completion"}`` as such tasks, with no outside text: the completion becomes the
document to summarise, the passage whose question (the row's own prompt) is to be
answered, or the source sentences to translate; a row that answered an
English-to-X translation prompt becomes an X-to-English one (back-translation,
Sennrich et al. 2016). The backbone then answers the new prompts in the usual
self-distillation, so the heads learn its behaviour on these tasks.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

KINDS = ("summarize", "passage-qa", "translate", "back-translate")
_FORWARD = KINDS[:3]
LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Chinese")

_SUMMARIZE = (
    "Summarize: {text}",
    "Summarize the following text in a few sentences.\n\n{text}",
    "Write a short summary of this article:\n\n{text}",
    "{text}\n\nGive me the main points of the text above in two or three sentences.",
)
_PASSAGE_QA = (
    "Answer the question using the passage.\n\nPassage: {text}\n\nQuestion: {question}",
    "{text}\n\nBased on the text above, answer this: {question}",
    "Read the following and answer the question at the end.\n{text}\nQuestion: {question}",
)
_TRANSLATE = (
    "Translate English to {lang}: {text}",
    "Translate into {lang}: {text}",
)
_BACK = re.compile(r"^Translate (?:English to|into) (\w+): ", re.S)


def _words(text: str, limit: int) -> str:
    words = text.split(" ")
    return text if len(words) <= limit else " ".join(words[:limit])


def _sentences(text: str, max_words: int) -> str:
    """The leading whole sentences of ``text`` (one paragraph) within ``max_words``."""
    para = next((p for p in text.split("\n") if len(p.split()) >= 8 and not p.rstrip().endswith(":")), "")
    out: list[str] = []
    for s in re.split(r"(?<=[.!?])\s+", para.strip()):
        if out and len(" ".join(out + [s]).split()) > max_words:
            break
        out.append(s)
    return _words(" ".join(out), max_words)


def derive_task_prompts(
    rows: Sequence[dict],
    seed: int = 0,
    kinds: Sequence[str] = KINDS,
    min_words: int = 40,
    max_words: int = 320,
) -> list[dict]:
    """One task prompt per usable row, the task drawn at random from ``kinds``.

    Args:
        rows: ``{"prompt": str, "completion": str}`` (as in a run's ``data/train.jsonl``);
            rows with no completion, a non-string prompt, or a completion under
            ``min_words`` words are skipped.
        seed: the draw of task, template and language; same rows and seed, same output.
        kinds: any of :data:`KINDS`. ``summarize`` and ``passage-qa`` use the
            completion cut to ``max_words`` words (the row's prompt is the question);
            ``translate`` its first sentences (at most 60 words) into one of
            :data:`LANGUAGES`; ``back-translate`` turns a row that answered an
            English-to-X prompt into the X-to-English prompt of its answer (such rows
            give no other task).
    Returns:
        ``[{"prompt": str, "task": kind}]`` in the order of ``rows``.

    Raises:
        ValueError: an unknown kind, or no usable row.
    """
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"unknown task kind(s) {bad or kinds}: choose from {', '.join(KINDS)}")
    rng = random.Random(seed)
    out = []
    for row in rows:
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            continue
        completion = completion.strip()
        back = _BACK.match(prompt)
        if back:
            if "back-translate" in kinds and len(completion.split()) >= 4:
                text = _words(completion, 80)
                out.append(
                    {"prompt": f"Translate {back.group(1)} to English: {text}", "task": "back-translate"}
                )
            continue
        forward = [k for k in kinds if k in _FORWARD]
        if not forward or len(completion.split()) < min_words:
            continue
        kind = rng.choice(forward)
        if kind == "translate":
            text = _sentences(completion, 60)
            if len(text.split()) < 4:
                continue
            p = rng.choice(_TRANSLATE).format(lang=rng.choice(LANGUAGES), text=text)
        elif kind == "summarize":
            p = rng.choice(_SUMMARIZE).format(text=_words(completion, max_words))
        else:
            p = rng.choice(_PASSAGE_QA).format(text=_words(completion, max_words), question=prompt.strip())
        out.append({"prompt": p, "task": kind})
    if not out:
        raise ValueError(
            "no row to derive tasks from: rows need a string prompt and a completion "
            f"of at least {min_words} words"
        )
    return out
