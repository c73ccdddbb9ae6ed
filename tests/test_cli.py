"""The command line, end to end in subprocesses, on the tiny model; packaging."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "mlx-stream")


def run(*args, input=None, cwd=None):
    return subprocess.run([EXE, *args], capture_output=True, text=True, input=input, timeout=600, cwd=cwd)


def test_help_for_every_command():
    for cmd in ([], ["generate"], ["chat"], ["convert"], ["bench"], ["train"], ["eval-heads"]):
        r = run(*cmd, "--help")
        assert r.returncode == 0, r.stderr
        assert "Usage" in r.stdout


def test_generate_json(tiny_dir):
    r = run("generate", "--model", str(tiny_dir), "--prompt", "The quick", "--max-tokens", "7", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in (
        "text",
        "tokens",
        "finish_reason",
        "prompt_tokens",
        "generation_tokens",
        "forward_passes",
        "tau",
        "generation_tps",
    ):
        assert key in out
    assert out["generation_tokens"] == len(out["tokens"]) <= 7
    assert out["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--temp", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--tree", "1;;2"], "unknown tree"),
        (["--temp", "1", "--top-p", "0"], "top_p"),
        (["--temp", "1", "--top-p", "1.5"], "top_p"),
        (["--temp", "1", "--top-k", "-2"], "top_k"),
        (["--temp", "1", "--top-k", "100000"], "vocabulary size"),
        (["--temp", "1", "--min-p", "1.5"], "min_p"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--model", "no/such/thing/here"], "unknown model"),
        (["--model", "missing.gguf"], "GGUF file not found"),
    ],
)
def test_generate_bad_input_exits_2(tiny_dir, args, msg):
    base = ["generate", "--prompt", "hi", "--model", str(tiny_dir)]
    r = run(*base, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert msg in r.stderr
    assert "Traceback" not in r.stderr


def test_generate_sampling_flags_seed_and_logprobs(tiny_dir):
    args = [
        "generate",
        "-m",
        str(tiny_dir),
        "-p",
        "The quick",
        "--max-tokens",
        "12",
        "--temp",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--min-p",
        "0.05",
        "--repetition-penalty",
        "1.2",
        "--seed",
        "4",
        "--json",
        "--logprobs",
    ]
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["tokens"] == jb["tokens"] and ja["logprobs"] == jb["logprobs"]
    assert len(ja["logprobs"]) == len(ja["tokens"]) > 0 and all(x <= 0 for x in ja["logprobs"])
    assert "logprobs" not in json.loads(run(*args[:-1]).stdout)


def test_chat_turns_reset_and_eof(tiny_dir):
    r = run("chat", "--model", str(tiny_dir), "--max-tokens", "5", input="hello\n/reset\nagain \x07\xff\n")
    assert r.returncode == 0, r.stderr
    assert "[conversation cleared]" in r.stdout
    assert r.stderr.count("tokens,") == 2  # one stats line per reply


def test_convert_cli_refuses_what_it_cannot_convert(tmp_path):
    r = run("convert", str(tmp_path / "x.bin"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Hugging Face checkpoint folder, a .gguf file or a model alias" in r.stderr
    (tmp_path / "empty").mkdir()
    r = run("convert", str(tmp_path / "empty"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "config.json" in r.stderr and not (tmp_path / "o").exists()
    r = run("convert", str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--quantize", "--q-bits", "3")
    assert r.returncode == 2


def test_convert_takes_the_model_aliases(tmp_path):
    # the names --model takes: the alias's GGUF, converted into a folder plain mlx-lm loads
    r = run("convert", "smollm2-135m-instruct", "--out", str(tmp_path / "smol"))
    assert r.returncode == 0, r.stderr
    import mlx_lm

    model, tok = mlx_lm.load(str(tmp_path / "smol"))
    assert model.args.vocab_size == 49152 and tok.encode("hello")


def test_only_the_mlx_stream_namespace_is_installed(tmp_path):
    code = (
        "import importlib.util as u, sys; "
        "bad = [n for n in ('train', 'heads', 'convert', 'cli') if u.find_spec(n)]; "
        "import mlx_stream.train, mlx_stream.heads, mlx_stream.convert, mlx_stream.cli; "
        "sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_wheel_holds_only_mlx_stream(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("mlx_stream-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"mlx_stream"}
    shipped = "data/heads/smollm2-135m-instruct/"
    for mod in (
        "cli.py",
        "heads/__init__.py",
        "convert/gguf.py",
        "train/__init__.py",
        "data/prompts.jsonl",
        shipped + "datastore.npz",
    ):
        assert f"mlx_stream/{mod}" in names


@pytest.mark.slow  # ~90 s; the pipeline's stages and resume are also tested in test_train.py
def test_train_end_to_end_and_resume(tiny_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "The quick brown fox"}\n{"prompt": "heads, trees!"}\n{"prompt": "0123 café"}\n'
        '{"prompt": "drafts"}\n{"text": "Speculative decoding drafts tokens"}\n'
    )
    out = tmp_path / "run"
    args = [
        "train",
        "--model",
        str(tiny_dir),
        "--out",
        str(out),
        "--data",
        str(data),
        "--max-tokens",
        "12",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "8",
    ]
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert (out / "heads" / "heads.safetensors").is_file() and (out / "report.json").is_file()
    report = json.loads((out / "report.json").read_text())
    assert len(report["valid"]["top1"]) == 3 and "chain" in report["valid"]["tau"]
    rows = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and sum(r["prompt"] == "" for r in rows) == 1  # raw text kept, prompts distilled
    assert not (out / "features" / "train.parts").exists() and report["architecture"] == "hydra"
    # the heads carry the tree that the held-out ranks and this machine's forward costs chose
    search = report["tree_search"]
    cfg = json.loads((out / "heads" / "config.json").read_text())
    assert cfg["tree"] == search["sizes"][str(search["best"])]["tree"]
    # beside the heads: the datastore of the answers they trained on, for this tokenizer
    from mlx_stream.datastore import SEP, read_tokens
    from mlx_stream.loader import load

    m, tok = load(str(tiny_dir), heads=str(out / "heads"), dtype="float32")
    want = [t for r in rows for t in tok.encode(r["completion"], add_special_tokens=False) + [SEP]]
    assert (
        read_tokens(out / "heads" / "datastore.npz")[0].tolist()
        == want
        == m.datastore.parts[0].tokens.tolist()
    )
    assert report["datastore_tokens"] == len(want) - len(rows)
    (out / "heads" / "datastore.npz").unlink()  # as if killed before the store was saved
    r = run(*args)
    assert r.returncode == 2 and "--resume" in r.stderr
    r = run(*args, "--resume")  # every stage is found on disk and reused
    assert r.returncode == 0, r.stderr
    g = run(
        "generate",
        "--model",
        str(tiny_dir),
        "--heads",
        str(out / "heads"),
        "-p",
        "The quick",
        "--max-tokens",
        "6",
        "--json",
    )
    assert g.returncode == 0 and json.loads(g.stdout)["heads"] is True
    # continued training: new data (here with soft targets), the same heads grow
    more = tmp_path / "more"
    cont = [a if a != str(out) else str(more) for a in args]
    i = cont.index("--epochs")
    del cont[i : i + 2]  # a continued run's own defaults: 1 epoch at lr 3e-4, warm-up 20
    cont += ["--soft-targets", "8", "--kl-weight", "0.5", "--draft-vocab", "64"]  # a new draft vocabulary
    r = run(*cont, "--init-heads", str(out / "heads"), "--num-heads", "2")
    assert r.returncode == 2 and "num_heads 3" in r.stderr and "--num-heads 3" in r.stderr, r.stderr
    r = run(*cont, "--init-heads", str(out / "heads"))
    assert r.returncode == 0, r.stderr
    first, second = report, json.loads((more / "report.json").read_text())
    assert (second["config"]["epochs"], second["config"]["lr"], second["config"]["warmup"]) == (1.0, 3e-4, 20)
    assert first["config"]["lr"] == 1e-3
    seen = first["steps"] * 8  # optimizer steps x positions per step (batch 8, no accumulation)
    assert first["positions_seen_total"] == seen and second["positions_seen_before"] == seen
    assert second["positions_seen_total"] == seen + second["steps"] * 8
    assert (
        json.loads((more / "heads" / "config.json").read_text())["trained_positions"]
        == second["positions_seen_total"]
    )
    assert json.loads((more / "features" / "train" / "meta.json").read_text())["top_k"] == 8
    # the grown heads' datastore: the first run's answers, then this run's
    grown = read_tokens(more / "heads" / "datastore.npz")[0].tolist()
    assert grown[: len(want)] == read_tokens(out / "heads" / "datastore.npz")[0].tolist() == want
    assert len(grown) > len(want)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--num-heads", "0"], "num_heads"),
        (["--epochs", "0"], "epochs"),
        (["--data", "/nonexistent.jsonl"], "/nonexistent.jsonl: file not found"),
    ],
)
def test_train_bad_input_exits_2(tiny_dir, tmp_path, args, msg):
    r = run("train", "--model", str(tiny_dir), "--out", str(tmp_path / "o"), *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()  # nothing half-made is left to trip the next run


def test_eval_heads_reports_tau_per_group(tiny_dir, tmp_path):
    q = tmp_path / "question.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"The quick brown fox {i}", "second turn"]}
        for i, c in enumerate(["writing", "coding", "qa", "qa", "rag"])
    ]
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tau.json"
    r = run(
        "eval-heads",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(q),
        "--max-tokens",
        "6",
        "--heads",
        "none",
        "--workers",
        "2",
        "--per-category",
        "1",
        "--out",
        str(out),
    )  # (the same option as --per-group)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert (
        res["all"]["prompts"] == 3
        and res["group:mt-bench"]["prompts"] == 1
        and res["group:qa"]["prompts"] == 1
    )
    # the replayed evaluation reports the same rows (no heads: tau 1 exactly, same prompts)
    r = run(
        "eval-heads",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(q),
        "--max-tokens",
        "6",
        "--heads",
        "none",
        "--per-category",
        "1",
        "--replay",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text()) == res
    assert res["all"]["tau"] == pytest.approx(1.0)  # plain decoding: one token per pass


def test_train_resume_refuses_a_different_dataset(tiny_dir, tmp_path):
    """A distillation interrupted on one dataset is not continued on another: the
    partial parts index into the first dataset's rows."""
    out = tmp_path / "run"
    parts = out / "features" / "train.parts"
    parts.mkdir(parents=True)
    (parts / "parts.json").write_text(json.dumps({"rows": "0" * 16, "parts": 1}))
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a b c"}\n{"prompt": "d e f"}\n{"prompt": "g h i"}\n')
    r = run("train", "--model", str(tiny_dir), "--out", str(out), "--data", str(data), "--resume")
    assert r.returncode == 2 and "different dataset" in r.stderr, r.stderr


def test_train_eagle_heads_end_to_end(tiny_dir, tmp_path):
    """`--architecture eagle`: sequence features, training with training-time test,
    per-depth held-out accuracy, a tuned tree; the heads then decode."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"The quick brown fox {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "run"
    r = run(
        "train",
        "--model",
        str(tiny_dir),
        "--out",
        str(out),
        "--data",
        str(data),
        "--max-tokens",
        "16",
        "--architecture",
        "eagle",
        "--num-heads",
        "3",
        "--epochs",
        "2",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["architecture"] == "eagle" and len(report["valid"]["top1"]) == 3
    cfg = json.loads((out / "heads" / "config.json").read_text())
    assert cfg["architecture"] == "eagle" and cfg["layer_spec"]["model_type"] == "llama"
    assert cfg["tree"] == report["tree_search"]["sizes"][str(report["tree_search"]["best"])]["tree"]
    assert cfg["trained_positions"] == report["positions_seen_total"] > 0
    g = run(
        "generate",
        "--model",
        str(tiny_dir),
        "--heads",
        str(out / "heads"),
        "-p",
        "The quick",
        "--max-tokens",
        "8",
        "--tree",
        "0;1;0,0",
        "--json",
    )
    assert g.returncode == 0 and json.loads(g.stdout)["heads"] is True, g.stderr


def test_train_refuses_msa_and_unknown_architectures(tmp_path, tiny_dir):
    for arch, msg in (("msa", "compare_heads.py"), ("medusa9", "use one of: hydra, residual, eagle")):
        r = run("train", "--model", str(tiny_dir), "--out", str(tmp_path / arch), "--architecture", arch)
        assert r.returncode == 2 and msg in r.stderr, r.stderr
        assert not (tmp_path / arch).exists()


def test_bench_writes_report_and_plot(tiny_dir, tmp_path):
    out = tmp_path / "bench"
    r = run(
        "bench",
        "--model",
        str(tiny_dir),
        "--drafter",
        "oracle",
        "-n",
        "2",
        "--max-tokens",
        "8",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "report.json").read_text())
    assert res["prompts"] == 2 and res["identical"] == 2 and res["environment"]["blas"]
    assert "| all | 2 |" in (out / "report.md").read_text()
    oc = res["oracle_ceiling"]  # the loop's overhead against tau / c(N)
    assert oc["tree_nodes"] == 4 and oc["ceiling"] == pytest.approx(res["median_tau"] / oc["c"])
    assert "loop overhead" in r.stdout and "oracle ceiling" in (out / "report.md").read_text()
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*.tmp"))
    r = run(
        "bench",
        "--model",
        str(tiny_dir),
        "-n",
        "1",
        "--max-tokens",
        "8",
        "--temp",
        "0.8",
        "--top-k",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "report.json").read_text())
    assert res["identical"] is None and res["sampling"]["top_k"] == 5


def test_unwritable_outputs_are_refused_before_any_work(tiny_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cases = [
        ("convert", str(tiny_dir), "--out", str(blocker / "x")),
        ("train", "--model", str(tiny_dir), "--out", str(blocker / "run")),
        ("bench", "--model", str(tiny_dir), "--out", str(blocker)),
        ("eval-heads", "--model", str(tiny_dir), "--out", str(blocker / "tau.json")),
        ("eval-heads", "--model", str(tiny_dir), "--out", str(tmp_path)),  # a folder where a file goes
    ]
    for args in cases:
        r = run(*args)
        assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr, (
            args,
            r.stderr,
        )
        assert r.stderr.count("\n") == 1  # one line
    assert blocker.read_text() == "not a folder"


def test_corrupt_model_folders_give_one_line_errors(tiny_dir, tmp_path):
    import shutil

    cases = {}
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_dir, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    cases[bad] = "model.layers"
    bad = tmp_path / "badconfig"
    shutil.copytree(tiny_dir, bad)
    (bad / "config.json").write_text('{"model_type": "llama"')
    cases[bad] = "config.json"
    bad = tmp_path / "noweights"
    shutil.copytree(tiny_dir, bad)
    (bad / "model.safetensors").unlink()
    cases[bad] = "safetensors"
    for folder, msg in cases.items():
        r = run("generate", "--model", str(folder), "-p", "hi", "--max-tokens", "2")
        assert r.returncode == 2 and str(folder) in r.stderr and msg in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.slow  # four training runs SIGKILLed and resumed (make test-all)
def test_train_killed_at_any_point_resumes_to_the_same_heads(tiny_dir, tmp_path):
    """SIGKILL the whole `mlx-stream train` process group at several moments (prompts,
    distillation, features, training), then `--resume`: the heads equal an uninterrupted
    run's, and every file left behind is whole."""
    import os
    import signal
    import time

    import numpy as np
    from safetensors.numpy import load_file

    data = tmp_path / "d.jsonl"
    rows = [
        {"prompt": p}
        for p in [
            "The quick brown fox",
            "heads, trees!",
            "0123 café",
            "drafts",
            "Speculative decoding",
            "naïve café",
            "streams and trees",
            "fox jumps",
        ]
    ]
    # the tiny model answers every prompt with one token repeated, which its heads predict
    # from the start (a loss of 0: they would end where they began); a raw text they learn
    rows.append({"text": "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens."})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def args(out):
        return [
            EXE,
            "train",
            "--model",
            str(tiny_dir),
            "--out",
            str(out),
            "--data",
            str(data),
            "--max-tokens",
            "16",
            "--epochs",
            "3",
            "--batch-size",
            "8",
            "--checkpoint-every",
            "2",
            "--no-tune",
            "--workers",
            "2",
        ]

    tic = time.perf_counter()
    ref = subprocess.run(args(tmp_path / "ref"), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr
    wall = time.perf_counter() - tic
    want = load_file(str(tmp_path / "ref" / "heads" / "heads.safetensors"))
    moved = max(float(np.abs(v.astype(np.float32)).max()) for k, v in want.items() if ".out." in k)
    assert moved > 0.02, moved  # the output layers start at zero: trained far past the tolerance
    # one kill in the middle of a part's distillation, whatever the machine's speed (a kill
    # there once left "<w>.partial" folders that a resume took for part numbers), then by time
    for i, frac in enumerate(("distilling", 0.3, 0.6, 0.85)):
        out = tmp_path / f"run{i}"
        p = subprocess.Popen(
            args(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        if frac == "distilling":
            mark = out / "features" / "train.parts" / "0.partial" / "shape.json"
            while p.poll() is None and not mark.is_file():
                time.sleep(0.01)
            assert p.poll() is None, "the run ended before its distillation began"
        else:
            time.sleep(frac * wall)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        r = subprocess.run(args(out) + ["--resume"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (frac, r.stderr)
        got = load_file(str(out / "heads" / "heads.safetensors"))
        for k in want:
            np.testing.assert_allclose(
                got[k].astype(np.float32), want[k].astype(np.float32), atol=2e-3, err_msg=k
            )
        for f in (out / "data").glob("*.jsonl"):  # whole files only
            [json.loads(line) for line in f.read_text().splitlines()]


@pytest.mark.slow  # eleven commands (~100 s); the store's behaviour is in tests/test_datastore.py
def test_answers_grow_with_generate_show_add_and_clear(tiny_dir, tmp_path):
    def cli(*args, **env):
        e = {**os.environ, "MLX_STREAM_CACHE": str(tmp_path / "cache"), **env}
        return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=600, env=e)

    gen = ["generate", "--model", str(tiny_dir), "-p", "The quick", "--max-tokens", "6", "--json"]
    folder = tmp_path / "cache" / "answers"
    assert cli(*gen, MLX_STREAM_LEARN="0").returncode == 0 and not folder.exists()  # the setting
    assert cli(*gen, "--no-learn", MLX_STREAM_LEARN="1").returncode == 0 and not folder.exists()
    r = cli(*gen, MLX_STREAM_LEARN="1")  # on by default
    assert r.returncode == 0, r.stderr
    tokens = json.loads(r.stdout)["tokens"]
    r = cli(*gen, "--learn")
    assert r.returncode == 0, r.stderr
    r = cli("answers", "--model", str(tiny_dir))
    assert r.returncode == 0 and f": 2 answers, {2 * len(tokens)} tokens" in r.stdout, r.stdout + r.stderr
    data = tmp_path / "a.jsonl"
    data.write_text('{"prompt": "q", "completion": "heads, trees!"}\n{"prompt": "only a prompt"}\n')
    r = cli("answers", "--model", str(tiny_dir), "--add", str(data))
    assert r.returncode == 0 and "added 1 answers" in r.stdout and "1 rows without a completion" in r.stdout
    r = cli("answers", "--model", str(tiny_dir), "--add", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "file not found" in r.stderr
    r = cli("answers", "--model", str(tiny_dir), "--clear", "--add", str(data))
    assert r.returncode == 2 and "do not go together" in r.stderr
    r = cli(*gen, MLX_STREAM_LEARN="maybe")
    assert r.returncode == 2 and "MLX_STREAM_LEARN='maybe'" in r.stderr
    (tmp_path / "bytes.jsonl").write_bytes(b"\xfd\xfe{}")
    r = cli("answers", "--model", str(tiny_dir), "--add", str(tmp_path / "bytes.jsonl"))
    assert r.returncode == 2 and "bytes.jsonl: not UTF-8 text" in r.stderr
    # a corrupt store is set aside with a one-line warning; a folder in its place is an error
    (store,) = folder.glob("*.npz")
    store.write_bytes(b"garbage")
    r = cli("answers", "--model", str(tiny_dir))
    assert r.returncode == 0 and r.stderr.startswith("warning: ") and "moved aside" in r.stderr, r.stderr
    assert ": 0 answers" in r.stdout and len(list(folder.glob("*.bad-*"))) == 1
    store.mkdir()
    r = cli("answers", "--model", str(tiny_dir), "--add", str(data))
    assert r.returncode == 2 and "Traceback" not in r.stderr and str(store) in r.stderr, r.stderr
    r = cli(*gen, "--learn")  # decoding goes on; the answer is not stored
    assert r.returncode == 0 and "could not store this answer" in r.stderr, r.stderr
    store.rmdir()
    assert cli("answers", "--model", str(tiny_dir), "--add", str(data)).returncode == 0
    r = cli("answers", "--model", str(tiny_dir), "--clear")
    assert r.returncode == 0 and "cleared" in r.stdout
    assert ": 0 answers" in cli("answers", "--model", str(tiny_dir)).stdout


def test_generate_replaces_bytes_that_are_not_utf8_with_one_line(tiny_dir):
    """Issue 48: bytes that are not UTF-8 in -p, stdin (-p -), --system or --stop become
    U+FFFD with one note on stderr (as `chat` does), not a tokenizer traceback."""
    model = ["--model", str(tiny_dir), "--max-tokens", "3", "--json"]
    bad = os.fsdecode(b"hello \xff\xfe")  # as the shell hands it over: surrogate-escaped
    r = run("generate", "-p", bad, *model)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "2 byte(s) that are not UTF-8 replaced with U+FFFD" in r.stderr
    same = run("generate", "-p", "hello \ufffd\ufffd", *model)
    assert json.loads(r.stdout)["tokens"] == json.loads(same.stdout)["tokens"]
    piped = subprocess.run(
        [EXE, "generate", "-p", "-", *model], input=b"hi \xff there", capture_output=True, timeout=600
    )
    assert piped.returncode == 0 and b"1 byte(s) that are not UTF-8" in piped.stderr, piped.stderr
    r = run("generate", "-p", "hi", "--system", bad, "--stop", bad, *model)
    assert r.returncode == 0 and r.stderr.count("not UTF-8 replaced") == 2, r.stderr


def test_generate_refuses_tree_ranks_past_the_vocabulary_in_one_line(tiny_dir, tmp_path):
    """Issue 48: `--tree 8192` on a model of fewer tokens: one line naming the largest rank."""
    from mlx_stream import load
    from mlx_stream.heads import new_heads, save_heads

    model, tok = load(str(tiny_dir), heads=None)
    heads = save_heads(new_heads(model.backbone, tok, 2, seed=0, architecture="hydra"), tmp_path / "heads")
    v = model.args.vocab_size
    r = run("generate", "-p", "hi", "--model", str(tiny_dir), "--heads", str(heads), "--tree", "8192")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"largest allowed is {v - 1}" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# Issue 48's sweep: every option either takes effect or is refused. Each row: a command line
# in which an option would have been ignored, and the words of the one-line refusal.
IGNORED = [
    (["generate", "--heads", "x", "--no-heads"], "contradict each other"),
    (["generate", "--heads", "x", "--draft-model", "self"], "leave out --heads x"),
    (["generate", "--no-heads", "--draft-model", "self"], "leave out --no-heads"),
    (["generate", "--no-heads", "--tree", "0;1"], "no heads are loaded"),
    (["generate", "--tree", "auto"], "has no heads"),  # the tiny model ships none
    (["chat", "--tree", "chain"], "has no heads"),
    (["generate", "--kv-group-size", "32"], "add --kv-bits"),
    (["generate", "--quantized-kv-start", "0"], "add --kv-bits"),
    (["generate", "--logprobs"], "add --json"),
    (["generate", "--raw", "--system", "x"], "leave out --raw"),
    (["cache-prompt", "--system", "x", "--out", "F.safetensors", "--kv-group-size", "32"], "add --kv-bits"),
    (["server", "--heads", "x", "--draft-model", "self"], "leave out --heads x"),
    (["server", "--heads", "none", "--tree", "chain"], "no heads are loaded"),
    (["bench", "--drafter", "oracle", "--heads", "x"], "leave out --heads x"),
    (["bench", "--drafter", "oracle", "--prompt-lookup", "4"], "leave out --prompt-lookup"),
    (["bench", "--prompts", "spec-bench", "-n", "4"], "use --per-group"),
    (["bench", "--per-group", "2"], "only with --prompts spec-bench"),
    (["bench", "--heads", "none", "--tree", "chain"], "no heads are loaded"),
    (["eval-heads", "--replay", "--workers", "2"], "mlx.launch"),
    (["convert", "smollm2-135m-instruct", "--out", "OUT", "--q-bits", "8"], "add -q"),
    (["train", "--out", "OUT", "--data", "d.jsonl", "--synthesize", "10"], "pass one of them"),
    (["train", "--out", "OUT", "--soft-targets", "8"], "--kl-weight > 0"),
    (["train", "--out", "OUT", "--architecture", "eagle", "--batch-size", "64"], "not used by eagle heads"),
]


@pytest.mark.parametrize("args,msg", IGNORED, ids=[" ".join(a) for a, _ in IGNORED])
def test_an_option_that_would_be_ignored_is_refused_in_one_line(tiny_dir, tmp_path, args, msg):
    args = [str(tmp_path / a) if a in ("F.safetensors", "OUT") else a for a in args]
    model = [] if args[0] in ("convert",) else ["--model", str(tiny_dir)]
    prompt = ["-p", "hi"] if args[0] == "generate" else []
    r = run(*args, *model, *prompt, input="")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error:")]) == 1, r.stderr


def test_sampling_options_with_greedy_decoding_are_said_to_do_nothing(tiny_dir):
    """As mlx-lm, --top-p/--top-k/--min-p/--seed are accepted at --temp 0, with one note."""
    r = run(
        "generate", "-p", "hi", "--model", str(tiny_dir), "--max-tokens", "3", "--seed", "1", "--top-k", "5"
    )
    assert r.returncode == 0, r.stderr
    assert "note: --top-k, --seed apply only when sampling (--temp > 0)" in r.stderr
    r = run(
        "generate", "-p", "hi", "--model", str(tiny_dir), "--max-tokens", "3", "--temp", "0.5", "--seed", "1"
    )
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr
