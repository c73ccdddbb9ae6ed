"""The ``mlx-stream`` command line (typer). Installed as ``mlx_stream.cli``.

Each command is a few lines over one library function; MLX is imported inside the
command bodies so ``mlx-stream --help`` is instant.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

app = typer.Typer(
    help="Speculative Streaming on MLX: faster decoding with the same output, no draft model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_MODEL = "smollm2-135m-instruct"
_MODEL = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Alias, mlx-lm folder, .gguf file or Hugging Face repo id.")
_HEADS = typer.Option(
    "auto", "--heads",
    help="Heads folder; 'auto' = the heads shipped for the model if any, else plain decoding.",
)
_NO_HEADS = typer.Option(False, "--no-heads", help="Decode plainly (one token per forward pass).")
_TREE = typer.Option(
    None, "--tree",
    help="Draft tree: 'auto' (the heads' candidate that is fastest on this device, measured once), 'sparse', "
         "'chain', 'chain:K', 'none', or rank paths like '0;1;0,0;0,0,0'. Default: the tree stored with the heads.",
)
_LOOKUP = typer.Option(
    None, "--prompt-lookup",
    help="Most tokens drafted per step by prompt lookup (copying what followed the context's longest "
         "repeated suffix, 2 to 6 tokens) on top of the heads' tree; 0 turns it off. Default: 10 with heads, 0 without.",
)
_TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy.")
_SEED = typer.Option(None, "--seed", help="Seed for sampling: same seed and settings, same output.")
_TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]; 1 disables it.")
_TOP_K = typer.Option(0, "--top-k", help="Sample from the k most likely tokens; 0 disables it.")
_MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top token's probability; 0 disables it.")
_REP = typer.Option(None, "--repetition-penalty", help="mlx-lm's repetition penalty (> 0; 1 = none) over the last 20 tokens.")
_DTYPE = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16 | quantized")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _check_params(max_tokens: int, temp: float, tree: str | None, top_p: float = 1.0, top_k: int = 0,
                  min_p: float = 0.0, repetition_penalty: float | None = None,
                  prompt_lookup: int | None = None) -> dict:
    """Refuse bad parameters before anything is loaded; return the sampling keyword
    arguments of :func:`mlx_stream.stream_generate`."""
    import math

    from mlx_lm.sample_utils import make_logits_processors

    from mlx_stream.generate import check_generation
    from mlx_stream.sampling import SamplingParams
    from mlx_stream.tree import parse_tree

    try:
        check_generation(max_tokens, SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p))
        if repetition_penalty is not None and not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
            raise ValueError(f"--repetition-penalty must be a number > 0 (1 = none), got {repetition_penalty}")
        if prompt_lookup is not None and prompt_lookup < 0:
            raise ValueError(f"--prompt-lookup must be >= 0 (0: off), got {prompt_lookup}")
        if tree is not None and tree.strip() != "auto":
            parse_tree(tree, 1 << 10)  # syntax only; the depth is checked against the heads later
    except ValueError as e:
        _fail(str(e))
    return {"temp": temp, "top_p": top_p, "top_k": top_k, "min_p": min_p,
            "logits_processors": make_logits_processors(repetition_penalty=repetition_penalty)}


def _load(model: str, heads: str, no_heads: bool, dtype: str):
    from mlx_stream.loader import default_heads_path, load

    if no_heads or heads == "none":
        spec = None
    elif heads == "auto":
        spec = default_heads_path(model)
    else:
        spec = heads
    return load(model, heads=spec, dtype=dtype)


def _check_out(path: str, folder: bool) -> None:
    """Refuse an output path that cannot be written, before any work is done: the folder
    (``folder=True``) or the file's folder must exist or be creatable in a folder that
    accepts a file. Nothing is left behind."""
    import os
    import tempfile
    from pathlib import Path

    p = Path(path)
    where = p if folder else p.parent
    try:
        if p.exists() and p.is_dir() != folder:
            raise NotADirectoryError(f"{p} is {'a file' if folder else 'a folder'}")
        up = where  # nothing is created here: the nearest existing folder must take a file
        while not up.exists() and up != up.parent:
            up = up.parent
        if not up.is_dir():
            raise NotADirectoryError(f"{up} is a file")
        fd, probe = tempfile.mkstemp(dir=up, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        _fail(f"cannot write {'into ' if folder else ''}{p}: {e.strerror or e}; choose another --out")


def _blas_hint() -> None:
    from mlx_stream.env import blas_hint

    hint = blas_hint()
    if hint:
        typer.echo(hint, err=True)


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt ('-' reads stdin)."),
    model: str = _MODEL,
    heads: str = _HEADS,
    no_heads: bool = _NO_HEADS,
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate (> 0)."),
    temp: float = _TEMP,
    top_p: float = _TOP_P,
    top_k: int = _TOP_K,
    min_p: float = _MIN_P,
    repetition_penalty: Optional[float] = _REP,
    seed: Optional[int] = _SEED,
    tree: Optional[str] = _TREE,
    prompt_lookup: Optional[int] = _LOOKUP,
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt for the chat template."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    dtype: str = _DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    logprobs: bool = typer.Option(False, "--logprobs", help="With --json: each token's log-probability (as mlx-lm reports it)."),
):
    """Generate a completion for one prompt."""
    from mlx_stream.generate import stream_generate

    sampling = _check_params(max_tokens, temp, tree, top_p, top_k, min_p, repetition_penalty, prompt_lookup)
    if prompt == "-":
        prompt = sys.stdin.read()
    _blas_hint()
    try:
        m, tok = _load(model, heads, no_heads, dtype)
        text = prompt
        if not raw and tok.chat_template is not None:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=tok.bos_token is None or not text.startswith(tok.bos_token))
        pieces, tokens, lps, last = [], [], [], None
        for last in stream_generate(m, tok, ids, max_tokens=max_tokens, tree=tree, stop=stop, seed=seed,
                                    prompt_lookup=prompt_lookup, **sampling):
            pieces.append(last.text)
            tokens.extend(last.tokens)
            lps.extend(last.logprobs)
            if not as_json:
                typer.echo(last.text, nl=False)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps({
            "text": "".join(pieces), "tokens": tokens, "finish_reason": last.finish_reason,
            "prompt_tokens": last.prompt_tokens, "generation_tokens": last.generation_tokens,
            "forward_passes": last.forward_passes, "tau": round(last.tau, 4),
            "prompt_tps": round(last.prompt_tps, 2), "generation_tps": round(last.generation_tps, 2),
            "peak_memory_gb": round(last.peak_memory, 4), "heads": m.heads is not None,
        } | ({"logprobs": lps} if logprobs else {})))
    else:
        typer.echo(
            f"\n[{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, tau {last.tau:.2f}, "
            f"{last.finish_reason}]",
            err=True,
        )


@app.command()
def chat(
    model: str = _MODEL,
    heads: str = _HEADS,
    no_heads: bool = _NO_HEADS,
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Most tokens per reply."),
    temp: float = _TEMP,
    top_p: float = _TOP_P,
    top_k: int = _TOP_K,
    min_p: float = _MIN_P,
    repetition_penalty: Optional[float] = _REP,
    seed: Optional[int] = _SEED,
    tree: Optional[str] = _TREE,
    prompt_lookup: Optional[int] = _LOOKUP,
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    dtype: str = _DTYPE,
):
    """Multi-turn chat; the KV cache is reused across turns. /reset clears, /exit quits."""
    from mlx_stream.chat import ChatSession

    sampling = _check_params(max_tokens, temp, tree, top_p, top_k, min_p, repetition_penalty, prompt_lookup)
    _blas_hint()
    try:
        m, tok = _load(model, heads, no_heads, dtype)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if tok.chat_template is None:
        _fail(f"{model} has no chat template; use `mlx-stream generate --raw`")
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")
    session = ChatSession(m, tok, system=system, max_tokens=max_tokens, tree=tree, seed=seed,
                          prompt_lookup=prompt_lookup, **sampling)
    mode = "stream heads" if m.heads is not None else "plain decoding"
    typer.echo(f"mlx-stream chat: {model} ({mode}). /reset clears the conversation, /exit quits, Ctrl-C stops a reply.")
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo()
            return
        line = "".join(ch for ch in line if ch.isprintable() or ch in "\t\n")
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            session.reset()
            typer.echo("[conversation cleared]")
            continue
        if not line.strip():
            continue
        last = None
        try:
            for last in session.send(line):
                typer.echo(last.text, nl=False)
        except KeyboardInterrupt:
            typer.echo("\n[stopped]")
        except ValueError as e:
            typer.echo(f"\nerror: {e}", err=True)
            continue
        if last is not None:
            typer.echo(
                f"\n[{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, tau {last.tau:.2f}, "
                f"prompt {last.prompt_tokens} tokens]",
                err=True,
            )


@app.command()
def convert(
    src: str = typer.Argument(..., help="A Hugging Face checkpoint folder (Llama 2 or OPT) or a llama-architecture .gguf file."),
    out: str = typer.Option(..., "--out", "-o", help="Output folder (must not exist or be empty)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="HF checkpoints: float32 | float16 | bfloat16 (default: as stored)."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="HF checkpoints: quantise the weights (mlx-lm affine)."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per weight when quantising: 4 or 8."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Weights per quantisation group: 32, 64 or 128."),
    dequantize: bool = typer.Option(False, "--dequantize", help="GGUF: store float32 weights instead of quantised ones."),
):
    """Convert a checkpoint into an mlx-lm model folder (loadable by mlx_lm.load and mlx-stream)."""
    from pathlib import Path

    from mlx_stream.convert import convert_gguf, convert_hf

    _check_out(str(Path(out).resolve().parent), folder=True)
    try:
        if src.endswith(".gguf"):
            if quantize or dtype:
                _fail("--quantize and --dtype apply to Hugging Face checkpoints; a GGUF keeps its own types "
                      "(--dequantize gives float32)")
            path = convert_gguf(src, out, dequantize=dequantize)
        elif Path(src).is_dir():
            path = convert_hf(src, out, dtype=dtype, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size)
        else:
            _fail(f"{src}: expected a Hugging Face checkpoint folder or a .gguf file")
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    typer.echo(f"wrote {path}")


@app.command()
def bench(
    model: str = _MODEL,
    heads: str = _HEADS,
    drafter: str = typer.Option("heads", "--drafter", help="heads | oracle (drafts the target's own output: the loop's ceiling)"),
    prompts: str = typer.Option("builtin", "--prompts", help="A jsonl file ('prompt', Spec-Bench 'turns' or 'messages'), 'builtin', or 'spec-bench' (../shared/data/spec_bench/question.jsonl, --per-group from each task group)."),
    limit: int = typer.Option(8, "--limit", "-n", help="How many prompts."),
    per_group: int = typer.Option(8, "--per-group", "--per-category", help="With --prompts spec-bench: the first N questions of each of the 6 task groups (categories)."),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    tree: Optional[str] = _TREE,
    prompt_lookup: Optional[int] = _LOOKUP,
    dtype: str = _DTYPE,
    temp: float = _TEMP,
    top_p: float = _TOP_P,
    top_k: int = _TOP_K,
    min_p: float = _MIN_P,
    seed: int = typer.Option(0, "--seed", help="Prompt i is sampled with seed + i (both sides)."),
    out: Optional[str] = typer.Option(None, "--out", help="Write report.json, report.md and report.png into this folder."),
):
    """Side-by-side against plain mlx-lm (same weights, one process, interleaved);
    greedy by default (identity checked), or sampled with the same settings."""
    from pathlib import Path

    from mlx_stream import OracleDrafter
    from mlx_stream.bench import compare, environment, forward_cost, load_prompts, load_spec_bench, summary, write_report
    from mlx_stream.env import openblas_loaded
    from mlx_stream.tree import parse_tree

    if drafter not in ("heads", "oracle"):
        _fail(f"unknown drafter {drafter!r}: use heads or oracle")
    sampling = _check_params(max_tokens, temp, tree, top_p, top_k, min_p, prompt_lookup=prompt_lookup)
    sampling.pop("logits_processors")
    if out:
        _check_out(out, folder=True)
    if drafter == "oracle" and temp > 0:
        _fail("--drafter oracle drafts the greedy output: use it with --temp 0")
    try:
        auto = tree is not None and tree.strip() == "auto"
        if auto and drafter == "oracle":
            raise ValueError("--tree auto chooses among the heads' trees; give the oracle a tree shape")
        check = parse_tree(tree, 1 << 10) if tree is not None and not auto else None
        groups = None
        if prompts == "spec-bench":
            items = load_spec_bench(Path("../shared/data/spec_bench/question.jsonl"), per_group)
            texts, groups = [it["prompt"] for it in items], [it["group"] for it in items]
        else:
            path = Path(__file__).parent / "data" / "prompts.jsonl" if prompts == "builtin" else Path(prompts)
            texts = load_prompts(path, limit)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    _blas_hint()
    try:
        m, tok = _load(model, heads, drafter == "oracle", dtype)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    make = None
    if drafter == "oracle":
        shape = check if check is not None else parse_tree("chain:3", 3)
        make = lambda ids, ref: OracleDrafter(len(ids), ref, shape, m.args.vocab_size)  # noqa: E731
    elif m.heads is None:
        typer.echo("note: no heads loaded; this measures plain decoding through the loop", err=True)
    chosen = None
    if auto:
        from mlx_stream.autotree import auto_tree

        try:
            _, info = auto_tree(m)
        except ValueError as e:
            _fail(str(e))
        chosen = info["sizes"][info["best"]] | {"cached": info["cached"]}
        tree = chosen["tree"]
        typer.echo(f"tree auto: {tree} ({chosen['nodes']} drafted nodes): expected tau {chosen['tau']:.2f}, "
                   f"cost {chosen['cost']:.2f}, speedup bound x{chosen['speedup_bound']:.2f}"
                   f"{' (cached choice)' if info['cached'] else ''}")
    sizes = {1, 2, 4, 8, 16} | ({shape.size} if drafter == "oracle" else set())
    cost = forward_cost(m, sizes=tuple(sorted(sizes)))
    typer.echo("c(N) = " + ", ".join(f"{n}: {c:.2f}" for n, c in cost.items() if n != "t1_ms")
               + f"  (1-token forward {cost['t1_ms']:.1f} ms)")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("bench", total=len(texts))

        def show(r):
            bar.console.print(
                f"prompt {r.prompt:3d}: {r.tokens:4d} tokens  plain {r.plain_tps:6.1f} tok/s  "
                f"mlx-stream {r.spec_tps:6.1f} tok/s  x{r.speedup:.2f}  tau {r.tau:.2f}  "
                f"{'sampled' if r.identical is None else 'identical' if r.identical else 'DIFFERENT'}",
                highlight=False)
            bar.advance(task)

        res = summary(compare(m, tok, texts, max_tokens, make_drafter=make, tree=tree, progress=show,
                              sampling=sampling, seed=seed, prompt_lookup=prompt_lookup), groups)
    res.update({"model": model, "heads": heads if m.heads is not None else None, "drafter": drafter,
                "tree": tree, "tree_auto": chosen, "prompt_lookup": prompt_lookup, "dtype": dtype, "max_tokens": max_tokens, "sampling": sampling, "seed": seed,
                "command": "mlx-stream " + " ".join(sys.argv[1:]), "environment": environment(dtype),
                "openblas": openblas_loaded(), "forward_cost": {str(k): v for k, v in cost.items()}})
    typer.echo(f"median speedup x{res['median_speedup']:.2f}, median tau {res['median_tau']:.2f}, "
               f"identical {res['identical'] if res['identical'] is not None else 'n/a'}/{res['prompts']}, plain {res['median_plain_tps']:.1f} tok/s, "
               f"mlx-stream {res['median_spec_tps']:.1f} tok/s")
    for g, v in res.get("per_group", {}).items():
        typer.echo(f"  {g:16s} speedup x{v['median_speedup']:.2f}  tau {v['median_tau']:.2f}  ({v['prompts']} prompts)")
    if drafter == "oracle":
        # every rank-0 draft is accepted: tau / c(N) is what a loop without overhead would reach
        ceiling = res["median_tau"] / cost[shape.size]
        res["oracle_ceiling"] = {"tree_nodes": shape.size, "c": cost[shape.size], "ceiling": ceiling,
                                 "loop_overhead": 1 - res["median_speedup"] / ceiling}
        typer.echo(f"oracle ceiling tau / c({shape.size}) = {res['median_tau']:.2f} / {cost[shape.size]:.2f} = "
                   f"x{ceiling:.2f}; measured x{res['median_speedup']:.2f}: loop overhead "
                   f"{100 * res['oracle_ceiling']['loop_overhead']:.0f}% (prefill included)")
    if out:
        try:
            paths = write_report(res, out)
        except OSError as e:
            _fail(f"cannot write the report into {out}: {e}")
        typer.echo("wrote " + ", ".join(str(p) for p in paths))


@app.command()
def train(
    out: str = typer.Option(..., "--out", "-o", help="Run folder: data, features, checkpoint, heads, report.json."),
    model: str = _MODEL,
    data: Optional[str] = typer.Option(None, "--data", help="Prompts/dataset jsonl (mlx-lm formats); default: Magpie prompts."),
    synthesize: int = typer.Option(512, "--synthesize", help="Self-synthesised prompts when --data is not given."),
    distill: bool = typer.Option(True, "--distill/--no-distill", help="Let the backbone write the completions (default)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Completion length for self-distillation."),
    workers: int = typer.Option(1, "--workers", help="Self-distillation processes (2 suits a 2-core CPU)."),
    gen_batch_size: int = typer.Option(32, "--gen-batch-size", help="Sequences generated together per process."),
    num_heads: int = typer.Option(3, "--num-heads", "-k", help="Stream heads K."),
    architecture: str = typer.Option("hydra", "--architecture", help="Head architecture: hydra or residual."),
    num_layers: int = typer.Option(1, "--num-layers", help="Blocks per head."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Tokens the heads score (most frequent); 0 = all."),
    epochs: float = typer.Option(3.0, "--epochs"),
    batch_size: int = typer.Option(256, "--batch-size", help="Positions (tokens) per micro-batch."),
    grad_accum: int = typer.Option(1, "--grad-accum"),
    lr: float = typer.Option(1e-3, "--lr"),
    kl_weight: float = typer.Option(0.0, "--kl-weight", help="Weight of the KL to the backbone's distribution (soft targets)."),
    head_decay: float = typer.Option(0.8, "--head-decay", help="Loss weight of head j is head_decay**(j-1)."),
    warmup: int = typer.Option(50, "--warmup", help="Warm-up optimizer steps."),
    checkpoint_every: int = typer.Option(200, "--checkpoint-every"),
    seed: int = typer.Option(0, "--seed"),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out where it stopped."),
    tune: bool = typer.Option(True, "--tune/--no-tune", help="Store the draft tree that is fastest on this machine with the heads."),
):
    """Train stream heads against the frozen backbone."""
    from mlx_stream.train.pipeline import run
    from mlx_stream.train.trainer import TrainConfig

    if draft_vocab < 0:
        _fail(f"--draft-vocab must be >= 0, got {draft_vocab}")
    from mlx_stream.heads import ARCHITECTURES

    if architecture == "msa":
        _fail("msa heads train on whole sequences and are not trained by `mlx-stream train`; they are "
              "compared in benchmarks/compare_heads.py (README: hydra heads are better with a frozen backbone)")
    if architecture not in ARCHITECTURES:
        _fail(f"unknown --architecture {architecture!r}; use one of: hydra, residual")
    for name, v in (("--num-heads", num_heads), ("--batch-size", batch_size), ("--grad-accum", grad_accum),
                    ("--max-tokens", max_tokens), ("--num-layers", num_layers), ("--workers", workers),
                    ("--gen-batch-size", gen_batch_size)):
        if v < 1:
            _fail(f"{name} must be >= 1, got {v}")
    if epochs <= 0 or lr <= 0:
        _fail("--epochs and --lr must be > 0")
    if kl_weight < 0 or head_decay <= 0:
        _fail("--kl-weight must be >= 0 and --head-decay > 0")
    _check_out(out, folder=True)
    _blas_hint()
    cfg = TrainConfig(num_heads=num_heads, num_layers=num_layers, epochs=epochs, kl_weight=kl_weight,
                      head_decay=head_decay, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                      warmup=warmup, checkpoint_every=checkpoint_every, seed=seed)
    try:
        report = run(model, out, cfg, data=data, synthesize=synthesize, distill=distill, max_tokens=max_tokens,
                     resume=resume, draft_vocab=draft_vocab, architecture=architecture, workers=workers,
                     gen_batch_size=gen_batch_size, tune=tune)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{e.filename or out}: {e.strerror or e}")
    v = report.get("valid", {})
    typer.echo(f"heads: {out}/heads  top-1 {v.get('top1')}  top-5 {v.get('top5')}  implied tau {v.get('tau')}")


@app.command("eval-heads")
def eval_heads(
    model: str = _MODEL,
    heads: str = _HEADS,
    prompts: str = typer.Option(
        "spec-bench", "--prompts",
        help="Spec-Bench question.jsonl, or 'spec-bench' for ../shared/data/spec_bench/question.jsonl.",
    ),
    per_group: Optional[int] = typer.Option(None, "--per-group", "--per-category", help="First N questions of each task group (category)."),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    tree: Optional[str] = _TREE,
    prompt_lookup: Optional[int] = _LOOKUP,
    dtype: str = _DTYPE,
    out: Optional[str] = typer.Option(None, "--out", help="Write the result as JSON to this file."),
    workers: int = typer.Option(1, "--workers", help="Decoding processes (2 suits a 2-core CPU)."),
):
    """Greedy decoding over Spec-Bench first turns: tau overall, per task group and per category."""
    from pathlib import Path

    from mlx_stream.bench import decode_items_in_processes, load_spec_bench, pool_tau, tau_by_category

    from mlx_stream.loader import default_heads_path

    _check_params(max_tokens, 0.0, tree, prompt_lookup=prompt_lookup)
    if out:
        _check_out(out, folder=False)
    if workers < 1:
        _fail(f"--workers must be >= 1, got {workers}")
    path = Path("../shared/data/spec_bench/question.jsonl") if prompts == "spec-bench" else Path(prompts)
    try:
        items = load_spec_bench(path, per_group)
        m, tok = _load(model, heads, False, dtype)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if m.heads is None:
        typer.echo("note: no heads loaded; tau will be 1.0", err=True)
    if workers > 1:
        spec = None if m.heads is None else (default_heads_path(model) if heads == "auto" else heads)
        del m, tok
        try:
            res = pool_tau(decode_items_in_processes(model, spec, dtype, items, max_tokens, tree, workers,
                                                     prompt_lookup))
        except RuntimeError as e:
            _fail(str(e))
    else:
        res = tau_by_category(m, tok, items, max_tokens, tree, prompt_lookup=prompt_lookup,
                              progress=lambda k, s: typer.echo(f"{k}/{len(items)}  tau so far {s['tau']:.3f}", err=True))
    for key, v in res.items():
        typer.echo(f"{key:28s} tau {v['tau']:.3f}  ({v['prompts']} prompts)")
    if out:
        from mlx_stream.bench import write_json

        write_json(res, out)


def main() -> None:
    """The ``mlx-stream`` console command."""
    app()


if __name__ == "__main__":
    main()
