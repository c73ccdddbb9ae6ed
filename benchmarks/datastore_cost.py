"""What the datastore costs: drafting time per step and the answer store's size.

Drafting: the chain lookup a decoding step makes (:meth:`DraftStore.lookup_ngram`, the
longest matched suffix and its most frequent continuation, up to 10 tokens) over the
heads' store plus this machine's answers, timed at every position of held-out answers
(the contexts a decode meets). Growth: ``--generations`` answers appended one at a
time through :class:`AnswerStore` (locked read-extend-rewrite, as each generation
does), then the file's size and the time of one append.

    python benchmarks/datastore_cost.py --answers runs/a/data/train.jsonl --eval runs/b/data/train.jsonl

(``--answers``: completions that fill the store, cycled to ``--generations``; ``--eval``:
completions whose positions are looked up.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mlx_stream.datastore import STORE_FILE, AnswerStore, DraftStore, load_store
from mlx_stream.heads import backbone_fingerprint
from mlx_stream.loader import default_heads_path, load
from mlx_stream.prompts import read_jsonl


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--answers", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--generations", type=int, default=1000)
    ap.add_argument("--positions", type=int, default=5000, help="lookups timed at most")
    a = ap.parse_args()

    model, tok = load(a.model, heads=None, dtype="float32")
    fp = backbone_fingerprint(model.backbone, tok)
    answers = [
        tok.encode(r["completion"], add_special_tokens=False)
        for r in read_jsonl(a.answers)
        if r.get("completion")
    ]
    evals = [
        tok.encode(r["completion"], add_special_tokens=False)
        for r in read_jsonl(a.eval)
        if r.get("completion")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        store = AnswerStore(Path(tmp) / "answers.npz", fp["tokenizer"])
        append_ms = []
        for i in range(a.generations):
            tic = time.perf_counter()
            store.append([answers[i % len(answers)]])
            append_ms.append(1e3 * (time.perf_counter() - tic))
        size = store.path.stat().st_size
        tokens = int((store.read() != -1).sum())
        tic = time.perf_counter()
        ds = DraftStore(
            load_store(default_heads_path(a.model) / STORE_FILE, fp["tokenizer"]), store, learn=False
        )
        build_s = time.perf_counter() - tic
    print(
        f"{a.generations} generations: {tokens} tokens stored, file {size / 1e6:.2f} MB; "
        f"append median {statistics.median(append_ms):.1f} ms, "
        f"last 100 {statistics.median(append_ms[-100:]):.1f} ms"
    )
    print(f"index of the heads' store + those answers: {len(ds)} tokens, built in {build_s:.2f} s")
    times, hits = [], 0
    for seq in evals:
        for t in range(2, len(seq)):
            if len(times) >= a.positions:
                break
            tic = time.perf_counter()
            n, draft = ds.lookup_ngram(seq[:t], 10)
            times.append(1e3 * (time.perf_counter() - tic))
            hits += bool(draft)
    times = np.array(times)
    print(
        f"drafting lookups at {len(times)} positions: median {np.median(times):.3f} ms, "
        f"p90 {np.percentile(times, 90):.3f} ms, max {times.max():.2f} ms; "
        f"a chain found at {hits / len(times):.0%}"
    )


if __name__ == "__main__":
    main()
