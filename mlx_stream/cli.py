"""The ``mlx-stream`` command line (typer). Installed as ``mlx_stream.cli``; the
top-level ``cli.py`` of a checkout runs it.

Each command parses its options, calls one library function and prints; MLX is
imported inside the command bodies so ``mlx-stream --help`` is instant. On Linux the
console command re-executes itself once with OpenBLAS preloaded where that library is
installed (:func:`mlx_stream.env.reexec_with_openblas`).
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path

import typer

from mlx_stream.defaults import (
    AUTO_TREE,
    CHAT_MAX_TOKENS,
    DEFAULT_HEADS,
    DEFAULT_MODEL,
    NO_HEADS,
    PROMPT_LOOKUP,
)
from mlx_stream.train.config import CONTINUED, TrainConfig

app = typer.Typer(
    help="Speculative Streaming on MLX: faster decoding with the same output, no draft model.\n\n"
    "Guides: README.md and docs/ (every command and option: docs/cli.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_MODEL = typer.Option(
    DEFAULT_MODEL, "--model", "-m", help="Alias, mlx-lm folder, .gguf file or Hugging Face repo id."
)
_HEADS = typer.Option(
    DEFAULT_HEADS,
    "--heads",
    help=f"Heads folder, or a published EAGLE-3 or DFlash folder; '{DEFAULT_HEADS}' = the heads "
    f"shipped for the model if any, 'mtp' = the model checkpoint's own MTP modules (DeepSeek-V3, "
    f"GLM-4.5, Qwen3-Next, Qwen3.5), '{NO_HEADS}' = plain decoding.",
)
_TREE = typer.Option(
    None,
    "--tree",
    help=f"Draft tree: '{AUTO_TREE}' (the heads' candidate that is fastest on this device, measured once), "
    "'sparse', 'chain', 'chain:K', 'none' (the heads draft nothing; prompt lookup and the "
    "datastore still do unless --prompt-lookup 0), rank paths like '0;1;0,0;0,0,0', or (eagle heads) "
    "'dynamic:N[,W[,D]]', EAGLE-2's dynamic tree of at most N nodes, W children a node, D deep "
    "('dynamic:auto': N that pays most on this "
    "device), or 'budget' (each step's tree chosen "
    "across the heads, prompt lookup and the datastore by estimated acceptance and this device's "
    "measured costs). Default: the tree stored with the heads (their sampled_tree, if they store "
    "one, when --temp > 0).",
)
_LOOKUP = typer.Option(
    None,
    "--prompt-lookup",
    help="Most tokens drafted per step by prompt lookup (copying what followed the context's longest "
    f"repeated suffix, 2 to 6 tokens) on top of the heads' tree; 0 turns it off. Default: {PROMPT_LOOKUP} "
    "with heads, 0 without.",
)
_LEARN = typer.Option(
    None,
    "--learn/--no-learn",
    help="Draft also from this machine's store of the model's past answers and add this run's answers "
    "to it (answers only, never prompts; `mlx-stream answers` shows or clears it). Default: on, "
    "unless the environment sets MLX_STREAM_LEARN=0.",
)
_DRAFT_MODEL = typer.Option(
    None,
    "--draft-model",
    help="A separate draft model that drafts instead of the heads: any form --model takes, sharing "
    "the target's tokenizer (a smaller model of the family, or a quantized copy: "
    "`mlx-stream convert -q`). It drafts a tree (--tree dynamic:N[,W[,D]] sets its size), or a chain "
    "with --num-draft-tokens. Guide: docs/drafting.md.",
)
_NUM_DRAFT = typer.Option(
    None, "--num-draft-tokens", help="With --draft-model: draft a chain of this many tokens (mlx-lm's name)."
)
_DRAFT_P_MIN = typer.Option(
    None,
    "--draft-p-min",
    help="With --draft-model: stop drafting once the draft's best path is less likely than this "
    "(llama.cpp's --draft-p-min; default 0.6, measured; 0: always the full depth).",
)
_TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy.")
_TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]; 1 disables it.")
_TOP_K = typer.Option(0, "--top-k", help="Sample from the k most likely tokens; 0 disables it.")
_MIN_P = typer.Option(
    0.0, "--min-p", help="Drop tokens below min_p x the top token's probability; 0 disables it."
)
_DTYPE = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16 | quantized")
_PER_GROUP = ("--per-group", "--per-category")


@dataclass
class DecodeOptions:
    """The options ``generate`` and ``chat`` share (one definition: :data:`_DECODE_OPTIONS`)."""

    model: str
    heads: str
    no_heads: bool
    dtype: str
    temp: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float | None
    seed: int | None
    tree: str | None
    prompt_lookup: int | None
    system: str | None
    max_kv_size: int | None
    kv_bits: int | None
    kv_group_size: int
    quantized_kv_start: int
    prompt_cache_file: str | None
    learn: bool | None
    draft_model: str | None = None
    num_draft_tokens: int | None = None
    draft_p_min: float | None = None
    adaptive: bool | None = None

    def __post_init__(self):
        if self.system is not None:
            self.system = _utf8_text(self.system, "--system")

    def generation(self, max_tokens: int) -> dict:
        """Keyword arguments of :func:`mlx_stream.stream_generate`, checked before anything
        is loaded (exit 2 with one line on a bad value)."""
        from mlx_stream.generate import KVSettings, check_generation, check_kv
        from mlx_stream.sampling import SamplingParams, make_processors

        try:
            check_generation(
                max_tokens,
                SamplingParams(self.temp, self.top_p, self.top_k, self.min_p),
                tree=self.tree,
                prompt_lookup=self.prompt_lookup,
            )
            check_kv(KVSettings(self.max_kv_size, self.kv_bits, self.kv_group_size, self.quantized_kv_start))
            _check_draft_options(self.draft_model, self.num_draft_tokens, self.tree, self.draft_p_min)
            self._check_combinations()
            processors = make_processors(self.repetition_penalty)
        except ValueError as e:
            _fail(str(e))
        _note_unused_sampling(self.temp, self.top_p, self.top_k, self.min_p, self.seed)
        return {
            "max_tokens": max_tokens,
            "temp": self.temp,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "tree": self.tree,
            "prompt_lookup": self.prompt_lookup,
            "logits_processors": processors,
            "max_kv_size": self.max_kv_size,
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size,
            "quantized_kv_start": self.quantized_kv_start,
            "num_draft_tokens": self.num_draft_tokens,
            "adaptive": self.adaptive,
        }

    def _check_combinations(self) -> None:
        # an option that another one makes meaningless is refused, not silently dropped
        explicit_heads = self.heads != DEFAULT_HEADS
        if self.no_heads and explicit_heads and self.heads != NO_HEADS:
            raise ValueError(f"--heads {self.heads} and --no-heads contradict each other: pass one")
        if self.draft_model is not None and (self.no_heads or (explicit_heads and self.heads != NO_HEADS)):
            given = "--no-heads" if self.no_heads else f"--heads {self.heads}"
            raise ValueError(
                f"--draft-model drafts instead of the heads: leave out {given} (the draft model is the "
                "only drafter; --prompt-lookup 0 leaves it alone)"
            )
        if self.no_heads or self.heads == NO_HEADS:
            _check_tree_without_heads(self.tree, self.draft_model)
        if self.kv_bits is None:
            given = [
                f"--{n} {v}"
                for n, v, d in (
                    ("kv-group-size", self.kv_group_size, 64),
                    ("quantized-kv-start", self.quantized_kv_start, 5000),
                )
                if v != d
            ]
            if given:
                raise ValueError(f"{' and '.join(given)} set(s) the quantized KV cache: add --kv-bits")

    def load(self):
        """``(model, tokenizer)``; exit 2 with one line when they cannot be loaded or an
        option does not apply to what was loaded."""
        heads = NO_HEADS if self.no_heads or self.draft_model else self.heads
        m, tok = _load(self.model, heads, self.dtype, _learn(self.learn), self.draft_model, self.draft_p_min)
        if m.heads is None:
            try:
                _check_tree_without_heads(self.tree, self.draft_model, f"{self.model} has no heads")
            except ValueError as e:
                _fail(str(e))
        lookup_off = self.prompt_lookup == 0 or (
            self.prompt_lookup is None and m.heads is None and m.draft_model is None and self.tree != "budget"
        )
        if self.learn is True and lookup_off:
            typer.echo(
                "note: --learn adds this run's answer to the store, but only prompt lookup drafts from it "
                "(off here: --prompt-lookup N turns it on)",
                err=True,
            )
        if self.system is not None and tok.chat_template is None:
            _fail(f"--system fills the chat template's system turn, but {self.model} has no chat template")
        return m, tok

    def prompt_cache(self, model, tokenizer):
        """The cache loaded from ``--prompt-cache-file``, or None; exit 2 when it cannot be."""
        if self.prompt_cache_file is None:
            return None
        from mlx_stream.prompt_cache import load_prompt_cache

        if self.max_kv_size is not None:
            _fail("--prompt-cache-file holds a full cache: it cannot be combined with --max-kv-size")
        try:
            cache = load_prompt_cache(self.prompt_cache_file, model, tokenizer)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
        q = cache.quantization
        if q is not None and q != (self.kv_bits, self.kv_group_size):
            # (else the loop would drop the cache and prefill everything again)
            _fail(
                f"{self.prompt_cache_file} holds a {q[0]}-bit KV cache in groups of {q[1]}: pass "
                f"--kv-bits {q[0]} --kv-group-size {q[1]} (quantized caches decode plainly: --no-heads)"
            )
        return cache


def _option(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


_DECODE_OPTIONS = [
    _option("model", str, _MODEL),
    _option("heads", str, _HEADS),
    _option(
        "no_heads",
        bool,
        typer.Option(False, "--no-heads", help="Decode plainly (one token per forward pass)."),
    ),
    _option("temp", float, _TEMP),
    _option("top_p", float, _TOP_P),
    _option("top_k", int, _TOP_K),
    _option("min_p", float, _MIN_P),
    _option(
        "repetition_penalty",
        float | None,
        typer.Option(
            None,
            "--repetition-penalty",
            help="mlx-lm's repetition penalty (> 0; 1 = none) over the last 20 tokens.",
        ),
    ),
    _option(
        "seed",
        int | None,
        typer.Option(None, "--seed", help="Seed for sampling: same seed and settings, same output."),
    ),
    _option("tree", str | None, _TREE),
    _option("prompt_lookup", int | None, _LOOKUP),
    _option(
        "system", str | None, typer.Option(None, "--system", help="System prompt for the chat template.")
    ),
    _option("dtype", str, _DTYPE),
    _option(
        "max_kv_size",
        int | None,
        typer.Option(
            None,
            "--max-kv-size",
            help="Bound the KV cache to this many tokens (mlx-lm's rotating cache: the first 4 and the "
            "most recent are attended to).",
        ),
    ),
    _option(
        "kv_bits",
        int | None,
        typer.Option(
            None,
            "--kv-bits",
            help="Store the KV cache quantized to this many bits (2-6 or 8, as mlx-lm; decodes plainly).",
        ),
    ),
    _option(
        "kv_group_size",
        int,
        typer.Option(64, "--kv-group-size", help="Group size of the quantized KV cache."),
    ),
    _option(
        "quantized_kv_start",
        int,
        typer.Option(
            5000, "--quantized-kv-start", help="Quantize the KV cache once it holds this many tokens."
        ),
    ),
    _option(
        "prompt_cache_file",
        str | None,
        typer.Option(
            None,
            "--prompt-cache-file",
            help="Start from a KV cache saved by `mlx-stream cache-prompt` or `mlx_lm.cache_prompt` "
            "(the prompt continues it).",
        ),
    ),
    _option("learn", bool | None, _LEARN),
    _option("draft_model", str | None, _DRAFT_MODEL),
    _option("num_draft_tokens", int | None, _NUM_DRAFT),
    _option("draft_p_min", float | None, _DRAFT_P_MIN),
    _option(
        "adaptive",
        bool | None,
        typer.Option(
            None,
            "--adaptive/--no-adaptive",
            help="Adaptive speculation: decode plainly while drafts do not pay (measured as it runs; "
            "the output is the same either way). Default: on, off with --num-draft-tokens (a chain "
            "drafted at every step, as mlx-lm's).",
        ),
    ),
]


def _decode_options(command):
    """Give ``command(opts: DecodeOptions, **own)`` the shared decoding options as its own
    command-line options (typer reads the signature set here)."""
    hints = typing.get_type_hints(command)  # this module's annotations are strings (__future__)
    own = [
        p.replace(annotation=hints[p.name])
        for p in inspect.signature(command).parameters.values()
        if p.name != "opts"
    ]
    names = [p.name for p in _DECODE_OPTIONS]

    @functools.wraps(command)
    def with_options(**kwargs):
        return command(DecodeOptions(**{n: kwargs.pop(n) for n in names}), **kwargs)

    with_options.__signature__ = inspect.Signature(own + _DECODE_OPTIONS)
    with_options.__annotations__ = {}  # typer takes the types from the signature
    del with_options.__wrapped__  # (else typer would read the undecorated signature)
    return with_options


def _fail(msg: str):
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _utf8_text(text: str, what: str) -> str:
    # bytes that are not UTF-8 (in argv they arrive as lone surrogates) become U+FFFD, as `chat`
    # does for what is typed, with one line saying so; the library refuses such text instead
    from mlx_stream.checks import replace_invalid_utf8

    text, replaced = replace_invalid_utf8(text)
    if replaced:
        typer.echo(f"note: {what}: {replaced} byte(s) that are not UTF-8 replaced with U+FFFD", err=True)
    return text


def _read_stdin() -> str:
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # counted and replaced by _utf8_text
    return sys.stdin.read()


def _learn(flag: bool | None) -> bool:
    from mlx_stream.datastore import learn_setting

    if flag is not None:
        return flag
    try:
        return learn_setting()
    except ValueError as e:
        _fail(str(e))


def _load(
    model: str,
    heads: str,
    dtype: str,
    learn: bool | str = False,
    draft_model: str | None = None,
    draft_p_min: float | None = None,
):
    from mlx_stream.loader import load

    try:
        return load(
            model, heads=heads, dtype=dtype, learn=learn, draft_model=draft_model, draft_p_min=draft_p_min
        )
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def _check_draft_options(
    draft_model: str | None, num_draft_tokens: int | None, tree: str | None, p_min: float | None = None
) -> None:
    # before anything is loaded: the draft model's options make sense together
    if num_draft_tokens is not None and draft_model is None:
        raise ValueError("--num-draft-tokens sets a draft model's chain: pass --draft-model too")
    if p_min is not None and draft_model is None:
        raise ValueError("--draft-p-min sets where a draft model stops drafting: pass --draft-model too")
    if p_min is not None and not 0.0 <= p_min < 1.0:
        raise ValueError(f"--draft-p-min must be in [0, 1) (0: draft to the full depth), got {p_min}")
    if num_draft_tokens is not None and num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {num_draft_tokens}")
    if draft_model is not None and tree is not None and not tree.strip().startswith("dynamic:"):
        raise ValueError(
            f"--tree {tree}: a draft model drafts its own tree; use --tree dynamic:N[,W[,D]] to size it "
            "or --num-draft-tokens K for a chain"
        )


def _check_tree_without_heads(tree: str | None, draft_model: str | None, why: str = "no heads are loaded"):
    # --tree picks the heads' tree (or sizes a draft model's): without either it would be ignored
    if tree is None or draft_model is not None or tree.strip() in ("none", "budget"):
        return
    raise ValueError(
        f"--tree {tree} picks the heads' draft tree, but {why}: leave out --tree (--tree budget or "
        "--prompt-lookup N draft without heads)"
    )


def _note_unused_sampling(temp, top_p, top_k, min_p, seed) -> None:
    # as mlx-lm, sampling options are accepted with greedy decoding, but said to do nothing
    if temp != 0:
        return
    given = [
        n for n, v, d in (("--top-p", top_p, 1.0), ("--top-k", top_k, 0), ("--min-p", min_p, 0.0)) if v != d
    ]
    given += ["--seed"] if seed is not None else []
    if given:
        typer.echo(
            f"note: {', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only when sampling "
            "(--temp > 0); greedy decoding ignores them",
            err=True,
        )


def _check_out(path: str, folder: bool) -> None:
    from mlx_stream.files import check_writable

    try:
        check_writable(path, folder)
    except ValueError as e:
        _fail(str(e))


def _blas_hint() -> None:
    from mlx_stream.env import blas_hint

    hint = blas_hint()
    if hint:
        typer.echo(hint, err=True)


def _stats(r) -> str:
    return f"[{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s, tau {r.tau:.2f}, {r.finish_reason}]"


@app.command()
@_decode_options
def generate(
    opts: DecodeOptions,
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt ('-' reads stdin)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate (> 0)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    logprobs: bool = typer.Option(
        False, "--logprobs", help="With --json: each token's log-probability (as mlx-lm reports it)."
    ),
):
    """Generate a completion for one prompt.

    Guide: docs/cli.md (drafting: docs/drafting.md, sampling: docs/sampling.md)
    """
    from mlx_stream.generate import stream_generate
    from mlx_stream.prompt_cache import prompt_after_cache

    if raw and opts.system is not None:
        _fail("--system fills the chat template's system turn: leave out --raw, or put it in the prompt")
    if logprobs and not as_json:
        _fail("--logprobs adds each token's log-probability to the --json output: add --json")
    settings = opts.generation(max_tokens)
    prompt = _utf8_text(_read_stdin() if prompt == "-" else prompt, "the prompt")
    # as mlx-lm's prompt: "\n" typed
    stop = [_utf8_text(s, "--stop").replace("\\n", "\n").replace("\\t", "\t") for s in stop]
    _blas_hint()
    m, tok = opts.load()
    cache = opts.prompt_cache(m, tok)
    try:
        text, _ = prompt_after_cache(tok, cache, prompt, opts.system, raw)
    except ValueError as e:
        _fail(f"{opts.prompt_cache_file}: {e}")
    pieces, tokens, lps, last = [], [], [], None
    try:
        for last in stream_generate(m, tok, text, stop=stop, prompt_cache=cache, **settings):
            pieces.append(last.text)
            tokens.extend(last.tokens)
            lps.extend(last.logprobs)
            if not as_json:
                typer.echo(last.text, nl=False)
    except ValueError as e:
        _fail(str(e))
    if not as_json:
        typer.echo()  # the text ends with a newline on stdout; the stats go to stderr
        typer.echo(_stats(last), err=True)
        return
    typer.echo(
        json.dumps(
            {
                "text": "".join(pieces),
                "tokens": tokens,
                "finish_reason": last.finish_reason,
                "prompt_tokens": last.prompt_tokens,
                "cached_tokens": last.cached_tokens,
                "generation_tokens": last.generation_tokens,
                "forward_passes": last.forward_passes,
                "tau": round(last.tau, 4),
                "prompt_tps": round(last.prompt_tps, 2),
                "generation_tps": round(last.generation_tps, 2),
                "peak_memory_gb": round(last.peak_memory, 4),
                "heads": m.heads is not None,
            }
            | ({"logprobs": lps} if logprobs else {})
        )
    )


@app.command()
@_decode_options
def chat(
    opts: DecodeOptions,
    max_tokens: int = typer.Option(CHAT_MAX_TOKENS, "--max-tokens", help="Most tokens per reply."),
):
    """Multi-turn chat; the KV cache is reused across turns. /help lists the commands.

    Guide: docs/cli.md (drafting: docs/drafting.md, sampling: docs/sampling.md)
    """
    from mlx_stream.chat import ChatSession
    from mlx_stream.prompt_cache import chat_system_for_cache
    from mlx_stream.repl import run_chat

    settings = opts.generation(max_tokens)
    _blas_hint()
    m, tok = opts.load()
    if tok.chat_template is None:
        _fail(f"{opts.model}: this model has no chat template; use `mlx-stream generate --raw`")
    cache, system = opts.prompt_cache(m, tok), opts.system
    if cache is not None:  # the conversation must start with its tokens (and its system prompt)
        try:
            system = chat_system_for_cache(tok, cache, system)
        except ValueError as e:
            _fail(f"{opts.prompt_cache_file}: {e}")
    try:
        session = ChatSession(m, tok, system=system, **settings)
    except ValueError as e:
        _fail(str(e))
    if cache is not None:
        session.cache = cache
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # invalid UTF-8 typed or piped in is not fatal
    run_chat(session, model_name=opts.model)


@app.command("cache-prompt")
def cache_prompt_command(
    out: str = typer.Option(..., "--out", "-o", help="The .safetensors file to write."),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="The prompt to cache ('-' reads stdin)."),
    system: str | None = typer.Option(None, "--system", help="A system prompt (alone: cache just it)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    model: str = _MODEL,
    dtype: str = _DTYPE,
    kv_bits: int | None = typer.Option(
        None, "--kv-bits", help="Store the cache quantized to this many bits."
    ),
    kv_group_size: int = typer.Option(
        64, "--kv-group-size", help="With --kv-bits: values per quantization group."
    ),
    quantized_kv_start: int = typer.Option(
        0, "--quantized-kv-start", help="With --kv-bits: quantize from this many tokens on."
    ),
):
    """Prefill a prompt once and save its KV cache (mlx-lm's format) for --prompt-cache-file.

    Guide: docs/memory.md
    """
    from mlx_stream.prompt_cache import cache_prompt, cached_prompt_text, save_prompt_cache

    if prompt is None and system is None:
        _fail("give --prompt, --system or both")
    if kv_bits is None and (kv_group_size != 64 or quantized_kv_start != 0):
        _fail("--kv-group-size and --quantized-kv-start set the quantized KV cache: add --kv-bits")
    if not out.endswith(".safetensors"):
        _fail(f"{out}: a prompt cache file name ends in .safetensors")
    _check_out(out, folder=False)
    if prompt is not None:
        prompt = _utf8_text(_read_stdin() if prompt == "-" else prompt, "the prompt")
    if system is not None:
        system = _utf8_text(system, "--system")
    _blas_hint()
    m, tok = _load(model, NO_HEADS, dtype)
    try:
        text = cached_prompt_text(tok, system, prompt, raw)
        cache = cache_prompt(
            m, tok, text, kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start
        )
        # recorded in the file: generate and chat check a prompt against it (and take its system prompt)
        cache.source = {"system": system, "prompt": prompt, "raw": raw or tok.chat_template is None}
        save_prompt_cache(out, cache, model, tok)
    except ValueError as e:
        _fail(str(e))
    typer.echo(f"{out}: {len(cache.tokens)} tokens cached")


@app.command()
def server(
    model: str = _MODEL,
    heads: str = _HEADS,
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (default: this machine only)."
    ),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    tree: str | None = _TREE,
    prompt_lookup: int | None = _LOOKUP,
    dtype: str = _DTYPE,
    max_tokens: int = typer.Option(512, "--max-tokens", help="max_tokens for requests that give none."),
    temp: float = typer.Option(0.0, "--temp", help="Temperature for requests that give none."),
    cache_slots: int = typer.Option(
        4, "--cache-slots", help="Prompt caches kept: conversations whose history is reused (>= 1)."
    ),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level."),
    learn: bool | None = _LEARN,
    draft_model: str | None = _DRAFT_MODEL,
    num_draft_tokens: int | None = _NUM_DRAFT,
    draft_p_min: float | None = _DRAFT_P_MIN,
    api_key: list[str] = typer.Option(
        [],
        "--api-key",
        help="Require 'Authorization: Bearer KEY' on every route but /health (repeatable; "
        "@FILE reads one key per line). Default: $MLX_STREAM_API_KEY (comma-separated), else none.",
    ),
    max_queue: int = typer.Option(
        32, "--max-queue", help="Requests that may wait while one decodes; beyond: 503 with Retry-After."
    ),
    max_body_mb: float = typer.Option(8.0, "--max-body-mb", help="Largest request body (MB); beyond: 413."),
    request_timeout: float | None = typer.Option(
        None,
        "--request-timeout",
        help="Seconds a request may decode; then it ends with finish_reason 'length'.",
    ),
):
    """OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health.

    Guide: docs/server.md
    """
    from mlx_stream.generate import check_generation

    if not 0 <= port <= 65535:
        _fail(f"--port must be in 0..65535, got {port}")
    if cache_slots < 1:
        _fail(f"--cache-slots must be >= 1, got {cache_slots}")
    if request_timeout is not None and not request_timeout > 0:
        _fail(f"--request-timeout must be > 0 seconds, got {request_timeout}")
    from mlx_stream.server import ServerLimits

    try:
        limits = ServerLimits(_api_keys(api_key), max_queue, int(max_body_mb * (1 << 20)))
    except ValueError as e:
        _fail(f"{e} (--api-key, --max-queue, --max-body-mb)")
    try:
        check_generation(max_tokens, temp, tree=tree, prompt_lookup=prompt_lookup)
        _check_draft_options(draft_model, num_draft_tokens, tree, draft_p_min)
        if draft_model is not None and heads not in (DEFAULT_HEADS, NO_HEADS):
            raise ValueError(f"--draft-model drafts instead of the heads: leave out --heads {heads}")
        if heads == NO_HEADS:
            _check_tree_without_heads(tree, draft_model)
    except ValueError as e:
        _fail(str(e))
    if draft_model is not None:
        heads = NO_HEADS  # (they would be loaded and never draft)
    from mlx_stream.server import serve

    _blas_hint()
    try:
        serve(
            model,
            heads=heads,
            host=host,
            port=port,
            dtype=dtype,
            max_tokens=max_tokens,
            temp=temp,
            log_level=log_level,
            cache_slots=cache_slots,
            learn=_learn(learn),
            tree=tree,
            prompt_lookup=prompt_lookup,
            draft_model=draft_model,
            num_draft_tokens=num_draft_tokens,
            draft_p_min=draft_p_min,
            limits=limits,
            request_timeout=request_timeout,
        )
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def _api_keys(given: list[str]) -> tuple[str, ...]:
    # --api-key KEY / @FILE (one key a line, '#' comments), else $MLX_STREAM_API_KEY
    import os

    keys = []
    for item in given or [k for k in os.environ.get("MLX_STREAM_API_KEY", "").split(",") if k.strip()]:
        if item.startswith("@"):
            try:
                lines = Path(item[1:]).read_text().splitlines()
            except OSError as e:
                _fail(f"--api-key {item}: cannot read the key file ({e})")
            keys += [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        else:
            keys.append(item.strip())
    if given and not keys:
        _fail("--api-key: no key given (an empty key file?)")
    return tuple(keys)


@app.command()
def convert(
    src: str = typer.Argument(
        ...,
        help="A Hugging Face checkpoint folder (Llama 2 or OPT), a llama-architecture .gguf file, or a "
        "model alias (smollm2-135m-instruct: its GGUF).",
    ),
    out: str = typer.Option(..., "--out", "-o", help="Output folder (must not exist or be empty)."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="HF checkpoints: float32 | float16 | bfloat16 (default: as stored)."
    ),
    quantize: bool = typer.Option(
        False, "--quantize", "-q", help="HF checkpoints: quantise the weights (mlx-lm affine)."
    ),
    q_bits: int | None = typer.Option(None, "--q-bits", help="With -q: bits per weight, 4 or 8 (default 4)."),
    q_group_size: int | None = typer.Option(
        None, "--q-group-size", help="With -q: weights per quantisation group, 32, 64 or 128 (default 64)."
    ),
    dequantize: bool = typer.Option(
        False, "--dequantize", help="GGUF: store float32 weights instead of quantised ones."
    ),
):
    """Convert a checkpoint into an mlx-lm model folder (loadable by mlx_lm.load and mlx-stream).

    Guide: docs/checkpoints.md
    """
    from pathlib import Path

    from mlx_stream.convert import convert_gguf, convert_hf
    from mlx_stream.loader import alias_gguf

    _check_out(str(Path(out).resolve().parent), folder=True)
    try:
        gguf = alias_gguf(src)  # an alias (the --model names): its GGUF file
        if gguf is not None:
            src = str(gguf)
        if not quantize and (q_bits is not None or q_group_size is not None):
            raise ValueError("--q-bits and --q-group-size set -q's quantisation: add -q (--quantize)")
        if src.endswith(".gguf"):
            if quantize or dtype:
                raise ValueError(
                    "--quantize and --dtype apply to Hugging Face checkpoints; a GGUF keeps its own "
                    "types (--dequantize gives float32)"
                )
            path = convert_gguf(src, out, dequantize=dequantize)
        elif Path(src).is_dir():
            if dequantize:
                raise ValueError(
                    "--dequantize applies to a quantised GGUF file; this is a Hugging Face folder"
                )
            path = convert_hf(
                src, out, dtype=dtype, quantize=quantize, q_bits=q_bits or 4, q_group_size=q_group_size or 64
            )
        else:
            raise ValueError(
                f"{src}: expected a Hugging Face checkpoint folder, a .gguf file or a model alias "
                "(smollm2-135m-instruct)"
            )
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    typer.echo(f"wrote {path}")


@app.command()
def bench(
    model: str = _MODEL,
    heads: str = _HEADS,
    drafter: str = typer.Option(
        "heads", "--drafter", help="heads | oracle (drafts the target's own output: the loop's ceiling)"
    ),
    prompts: str = typer.Option(
        "builtin",
        "--prompts",
        help="A jsonl file ('prompt', Spec-Bench 'turns' or 'messages'), 'builtin', or 'spec-bench' "
        "(the Spec-Bench copy shipped with the package, --per-group from each task group).",
    ),
    limit: int | None = typer.Option(
        None, "--limit", "-n", help="How many prompts of 'builtin' or a jsonl file (default 8)."
    ),
    per_group: int | None = typer.Option(
        None,
        *_PER_GROUP,
        help="With --prompts spec-bench: the first N questions of each of the 6 task groups (categories; "
        "default 8).",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    tree: str | None = _TREE,
    prompt_lookup: int | None = _LOOKUP,
    dtype: str = _DTYPE,
    temp: float = _TEMP,
    top_p: float = _TOP_P,
    top_k: int = _TOP_K,
    min_p: float = _MIN_P,
    seed: int | None = typer.Option(
        None, "--seed", help="With --temp > 0: prompt i is sampled with seed + i (both sides; default 0)."
    ),
    out: str | None = typer.Option(
        None, "--out", help="Write report.json, report.md and report.png into this folder."
    ),
    answers: bool = typer.Option(
        False,
        "--answers",
        help="Draft also from this machine's store of the model's past answers (read only: the "
        "benchmark's answers are not added).",
    ),
    draft_model: str | None = _DRAFT_MODEL,
    num_draft_tokens: int | None = _NUM_DRAFT,
    draft_p_min: float | None = _DRAFT_P_MIN,
    adaptive: bool | None = typer.Option(
        None,
        "--adaptive/--no-adaptive",
        help="Adaptive speculation (off: draft at every step). Default: on, off with --num-draft-tokens.",
    ),
):
    """Side-by-side against plain mlx-lm (same weights, one process, interleaved);
    greedy by default (identity checked), or sampled with the same settings. Under
    mlx.launch the prompts are split over the ranks and rank 0 reports.

    Guide: docs/benchmarks.md
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from mlx_stream.bench import Decoding, environment, side_by_side, write_report
    from mlx_stream.distributed import connect
    from mlx_stream.generate import check_generation
    from mlx_stream.prompts import select_prompts
    from mlx_stream.sampling import SamplingParams

    sampling = {"temp": temp, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    try:
        if drafter not in ("heads", "oracle"):
            raise ValueError(f"unknown drafter {drafter!r}: use heads or oracle")
        check_generation(max_tokens, SamplingParams(**sampling), tree=tree, prompt_lookup=prompt_lookup)
        _check_draft_options(draft_model, num_draft_tokens, tree, draft_p_min)
        if draft_model is not None and drafter == "oracle":
            raise ValueError("--draft-model and --drafter oracle are two drafters: pick one")
        if heads not in (DEFAULT_HEADS, NO_HEADS) and (drafter == "oracle" or draft_model is not None):
            other = "--drafter oracle" if drafter == "oracle" else "--draft-model"
            raise ValueError(f"{other} drafts instead of the heads: leave out --heads {heads}")
        if drafter == "oracle" and (prompt_lookup or answers):
            raise ValueError(
                "--drafter oracle drafts the reference output alone: leave out --prompt-lookup and --answers"
            )
        if prompts == "spec-bench" and limit is not None:
            raise ValueError("--limit counts 'builtin' or jsonl prompts; with spec-bench use --per-group N")
        if prompts != "spec-bench" and per_group is not None:
            raise ValueError("--per-group picks from each Spec-Bench group: only with --prompts spec-bench")
        if heads == NO_HEADS and drafter != "oracle":
            _check_tree_without_heads(tree, draft_model)
        texts, groups = select_prompts(prompts, limit or 8, per_group or 8)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    _note_unused_sampling(temp, top_p, top_k, min_p, seed)
    seed = seed or 0
    if out:
        _check_out(out, folder=True)
    _blas_hint()
    ranks = connect()
    oracle = drafter == "oracle"
    no_heads = oracle or draft_model is not None
    m, tok = _load(
        model, NO_HEADS if no_heads else heads, dtype, "read" if answers else False, draft_model, draft_p_min
    )
    if not oracle and m.heads is None and m.draft_model is None:
        try:
            _check_tree_without_heads(tree, draft_model, f"{model} has no heads")
        except ValueError as e:
            _fail(str(e))
        typer.echo("note: no heads loaded; this measures plain decoding through the loop", err=True)
    with Progress(
        TextColumn("bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not ranks.is_main,
    ) as bar:
        task = bar.add_task("bench", total=len(texts))

        def show(r):
            bar.console.print(
                f"prompt {r.prompt:3d}: {r.tokens:4d} tokens  plain {r.plain_tps:6.1f} tok/s  "
                f"mlx-stream {r.spec_tps:6.1f} tok/s  x{r.speedup:.2f}  tau {r.tau:.2f}  "
                f"{'sampled' if r.identical is None else 'identical' if r.identical else 'DIFFERENT'}",
                highlight=False,
            )
            bar.advance(task)

        try:
            res = side_by_side(
                m,
                tok,
                texts,
                Decoding(max_tokens, tree, prompt_lookup, sampling, num_draft_tokens, adaptive),
                groups,
                oracle=oracle,
                seed=seed,
                log=bar.console.print if ranks.is_main else lambda m: None,
                progress=show if ranks.is_main else None,
                ranks=ranks,
            )
        except ValueError as e:
            _fail(str(e))
    if not ranks.is_main:
        return
    res |= {
        "model": model,
        "heads": heads if m.heads is not None else None,
        "drafter": "draft model" if draft_model else drafter,
        "draft_model": draft_model,
        "num_draft_tokens": num_draft_tokens,
        "adaptive": adaptive,
        "prompt_lookup": prompt_lookup,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "sampling": sampling,
        "seed": seed,
        "command": "mlx-stream " + " ".join(sys.argv[1:]),
        "environment": environment(dtype),
        "ranks": ranks.size,
    }
    ident = res["identical"] if res["identical"] is not None else "n/a"
    typer.echo(
        f"median speedup x{res['median_speedup']:.2f}, median tau {res['median_tau']:.2f}, "
        f"identical {ident}/{res['prompts']}, plain {res['median_plain_tps']:.1f} tok/s, "
        f"mlx-stream {res['median_spec_tps']:.1f} tok/s"
    )
    for g, v in res.get("per_group", {}).items():
        typer.echo(
            f"  {g:16s} speedup x{v['median_speedup']:.2f}  tau {v['median_tau']:.2f}  "
            f"({v['prompts']} prompts)"
        )
    if "oracle_ceiling" in res:
        oc = res["oracle_ceiling"]
        typer.echo(
            f"oracle ceiling tau / c({oc['tree_nodes']}) = {res['median_tau']:.2f} / {oc['c']:.2f} = "
            f"x{oc['ceiling']:.2f}; measured x{res['median_speedup']:.2f}: loop overhead "
            f"{100 * oc['loop_overhead']:.0f}% (prefill included)"
        )
    if out:
        try:
            paths = write_report(res, out)
        except OSError as e:
            _fail(f"cannot write the report into {out}: {e}")
        typer.echo("wrote " + ", ".join(str(p) for p in paths))


_TC = TrainConfig()  # the training defaults (TrainConfig validates what the options give it)


@app.command()
def train(
    out: str = typer.Option(
        ..., "--out", "-o", help="Run folder: data, features, checkpoint, heads, report.json."
    ),
    model: str = _MODEL,
    data: str | None = typer.Option(
        None, "--data", help="Prompts/dataset jsonl (mlx-lm formats); default: Magpie prompts."
    ),
    synthesize: int = typer.Option(
        512, "--synthesize", help="Self-synthesised prompts when --data is not given."
    ),
    distill: bool = typer.Option(
        True, "--distill/--no-distill", help="Let the backbone write the completions (default)."
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Completion length for self-distillation."),
    workers: int = typer.Option(
        1,
        "--workers",
        help="Ranks to start on this machine (mlx.distributed; 2 suits a 2-core CPU). Under "
        "mlx.launch the launcher's ranks are used instead.",
    ),
    connect_timeout: float = typer.Option(
        120.0, "--connect-timeout", help="Seconds to wait for the other ranks (under mlx.launch) to connect."
    ),
    gen_batch_size: int = typer.Option(
        64, "--gen-batch-size", help="Sequences generated together per process."
    ),
    soft_targets: int = typer.Option(
        0,
        "--soft-targets",
        help="Store the backbone's top-K log-probabilities per position (e.g. 32) for --kl-weight; 0 = none.",
    ),
    init_heads: str | None = typer.Option(
        None,
        "--init-heads",
        help="Continue training these heads (same architecture and backbone) on this data, or fine-tune "
        "a published EAGLE-3 folder or the checkpoint's own MTP module ('mtp'); then --epochs, --lr and "
        "--warmup default to 1, 3e-4 and 20.",
    ),
    num_heads: int = typer.Option(_TC.num_heads, "--num-heads", "-k", help="Stream heads K."),
    architecture: str | None = typer.Option(
        None,
        "--architecture",
        help="Head architecture: hydra, residual, or eagle (a draft layer that attends to the context). "
        "[default: hydra; eagle for a published drafter's --init-heads]",
    ),
    num_layers: int = typer.Option(_TC.num_layers, "--num-layers", help="Blocks per head."),
    draft_vocab: int = typer.Option(
        8192, "--draft-vocab", help="Tokens the heads score (most frequent); 0 = all."
    ),
    epochs: float | None = typer.Option(
        None, "--epochs", help=f"Passes over the data. [default: {_TC.epochs:g}; 1 with --init-heads]"
    ),
    batch_size: int = typer.Option(
        _TC.batch_size, "--batch-size", help="Positions (tokens) per micro-batch."
    ),
    grad_accum: int = typer.Option(_TC.grad_accum, "--grad-accum"),
    lr: float | None = typer.Option(
        None, "--lr", help=f"Peak learning rate. [default: {_TC.lr:g}; 3e-4 with --init-heads]"
    ),
    kl_weight: float = typer.Option(
        _TC.kl_weight, "--kl-weight", help="Weight of the KL to the backbone's distribution (soft targets)."
    ),
    head_decay: float = typer.Option(
        _TC.head_decay, "--head-decay", help="Loss weight of head j is head_decay**(j-1)."
    ),
    warmup: int | None = typer.Option(
        None, "--warmup", help=f"Warm-up optimizer steps. [default: {_TC.warmup}; 20 with --init-heads]"
    ),
    checkpoint_every: int = typer.Option(_TC.checkpoint_every, "--checkpoint-every"),
    seed: int = typer.Option(_TC.seed, "--seed"),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out where it stopped."),
    tune: bool = typer.Option(
        True, "--tune/--no-tune", help="Store the draft tree that is fastest on this machine with the heads."
    ),
):
    """Train stream heads against the frozen backbone.

    Guide: docs/heads.md
    """
    from mlx_stream.train.pipeline import check_run_settings, published_drafter, run

    architecture = architecture or ("eagle" if published_drafter(init_heads) else "hydra")
    if data is not None and synthesize != 512:
        _fail("--synthesize makes prompts when --data is not given: pass one of them")
    if soft_targets and kl_weight == 0:
        _fail("--soft-targets K stores the backbone's top-K for the KL loss: give --kl-weight > 0 too")
    if architecture == "eagle":  # one draft layer trained on sequence batches: these do not apply
        given = [
            name
            for name, v, d in (
                ("--num-layers", num_layers, _TC.num_layers),
                ("--batch-size", batch_size, _TC.batch_size),
                ("--grad-accum", grad_accum, _TC.grad_accum),
                ("--kl-weight", kl_weight, _TC.kl_weight),
                ("--checkpoint-every", checkpoint_every, _TC.checkpoint_every),
                ("--soft-targets", soft_targets, 0),
            )
            if v != d
        ]
        if given:
            _fail(f"{', '.join(given)}: not used by eagle heads (one draft layer trained on whole sequences)")
    base = CONTINUED if init_heads is not None else {"epochs": _TC.epochs, "lr": _TC.lr, "warmup": _TC.warmup}
    epochs = base["epochs"] if epochs is None else epochs
    lr = base["lr"] if lr is None else lr
    warmup = base["warmup"] if warmup is None else warmup
    try:
        cfg = TrainConfig(
            num_heads=num_heads,
            num_layers=num_layers,
            epochs=epochs,
            kl_weight=kl_weight,
            head_decay=head_decay,
            batch_size=batch_size,
            grad_accum=grad_accum,
            lr=lr,
            warmup=warmup,
            checkpoint_every=checkpoint_every,
            seed=seed,
        )
        settings = {
            "max_tokens": max_tokens,
            "workers": workers,
            "gen_batch_size": gen_batch_size,
            "draft_vocab": draft_vocab,
            "architecture": architecture,
            "top_k": soft_targets,
        }
        check_run_settings(**settings)
    except ValueError as e:
        _fail(str(e))
    _check_out(out, folder=True)
    _blas_hint()
    try:
        report = run(
            model,
            out,
            cfg,
            data=data,
            synthesize=synthesize,
            distill=distill,
            resume=resume,
            tune=tune,
            init_heads=init_heads,
            connect_timeout=connect_timeout,
            **settings,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{e.filename or out}: {e.strerror or e}")
    if report is None:  # a rank other than 0 of a distributed run: rank 0 reports
        return
    v = report.get("valid", {})
    typer.echo(
        f"heads: {out}/heads  top-1 {v.get('top1')}  top-5 {v.get('top5')}  implied tau {v.get('tau')}"
    )


@app.command()
def tasks(
    sources: list[str] = typer.Argument(
        ..., help="jsonl files of {prompt, completion} rows, e.g. a train run's data/train.jsonl."
    ),
    out: str = typer.Option(
        ..., "--out", "-o", help="The jsonl of task prompts to write (for train --data)."
    ),
    kinds: str = typer.Option(
        "summarize,passage-qa,translate,back-translate",
        "--kinds",
        help="Comma-separated: summarize, passage-qa, translate, back-translate.",
    ),
    limit: int | None = typer.Option(None, "--limit", "-n", help="Keep the first N prompts."),
    seed: int = typer.Option(0, "--seed", help="Draw of task, template and language."),
):
    """Re-pose the backbone's own answers as summarisation, passage-QA and translation prompts.

    Guide: docs/heads.md
    """
    from mlx_stream.prompts import read_jsonl
    from mlx_stream.train.data import write_jsonl
    from mlx_stream.train.tasks import derive_task_prompts

    try:
        if limit is not None and limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        rows = [r for src in sources for r in read_jsonl(src)]
        derived = derive_task_prompts(
            rows, seed=seed, kinds=[k.strip() for k in kinds.split(",") if k.strip()]
        )
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    _check_out(out, folder=False)
    derived = derived[:limit]
    write_jsonl(derived, out)
    counts = {}
    for r in derived:
        counts[r["task"]] = counts.get(r["task"], 0) + 1
    typer.echo(f"{out}: {len(derived)} prompts (" + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")


@app.command()
def calibrate(
    model: str = _MODEL,
    draft_model: str = typer.Option(
        "self",
        "--draft-model",
        help="The draft to calibrate: any form --model takes, or 'self' (a subset of the model's layers).",
    ),
    dtype: str = _DTYPE,
    refresh: bool = typer.Option(
        True, "--refresh/--cached", help="Measure again (default) or show the cached result."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the measurements as JSON."),
):
    """Measure how a draft model (or the model's own layer subsets, 'self') drafts on this
    device: its greedy agreement with the model on held-out text, its forward's cost, the
    chain length with the best expected speedup (0: drafting does not pay here). The result
    is cached per model, draft and device and used by --draft-model.

    Guide: docs/drafting.md
    """
    import json

    from mlx_stream.calibrate import calibrate_draft, self_draft
    from mlx_stream.loader import load_draft

    _blas_hint()
    m, tok = _load(model, NO_HEADS, dtype)
    try:
        if draft_model.strip() == "self":
            _, info = self_draft(m, tok, refresh=refresh)
            rows = info["candidates"]
        else:
            draft = load_draft(draft_model, m, tok, dtype, calibrate=False)
            rows = [calibrate_draft(m, tok, draft, refresh=refresh) | {"keep": None}]
            info = rows[0]
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if json_out:
        typer.echo(json.dumps({k: v for k, v in info.items() if k != "key"}, indent=1))
        return
    for i, r in enumerate(rows):
        what = f"layers {','.join(map(str, r['keep']))}" if r.get("keep") else draft_model
        best = " <- chosen" if len(rows) > 1 and i == info.get("best") else ""
        typer.echo(
            f"{what}: agreement {r['alpha']:.3f}, forward {r['r']:.2f}x the model's, "
            f"best chain {r['depth'] or 'none'} (expected x{r['speedup']:.2f} of plain){best}"
        )
    chosen = rows[info.get("best", 0)]
    if chosen.get("node_costs"):
        from mlx_stream.drafters.draft_model import expand_count

        costs = ", ".join(f"{n} nodes {c:.2f}x" for n, c in chosen["node_costs"].items())
        most = expand_count(chosen["node_costs"], 1 << 10)
        typer.echo(
            f"a draft forward over several tree nodes costs, relative to one: {costs}: trees expand "
            f"{'up to ' + str(most) + ' nodes' if most > 1 else 'one node'} a depth (siblings are free)"
        )
    if all(r["depth"] == 0 for r in rows):
        typer.echo(
            "no draft pays on this device: --draft-model decodes plainly (--num-draft-tokens K forces it)"
        )


@app.command("answers")
def answers_command(
    model: str = _MODEL,
    clear: bool = typer.Option(False, "--clear", help="Delete the stored answers."),
    add: str | None = typer.Option(
        None,
        "--add",
        help="Add the completions of a jsonl file ({'prompt', 'completion'} rows, e.g. a training run's "
        "data/train.jsonl) as answers.",
    ),
):
    """This machine's store of a model's past answers, which drafting draws on: where it
    is and how much it holds; --clear deletes it, --add imports answers. Commands add to it
    unless --no-learn or MLX_STREAM_LEARN=0.

    Guide: docs/drafting.md
    """
    from mlx_stream.datastore import SEP, AnswerStore, answers_path
    from mlx_stream.heads import backbone_fingerprint
    from mlx_stream.loader import cache_dir
    from mlx_stream.prompts import read_jsonl

    if clear and add is not None:
        _fail("--clear and --add do not go together: run them one after the other")
    texts, skipped = None, 0
    if add is not None:
        try:
            rows = read_jsonl(add)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
        texts = [r["completion"] for r in rows if isinstance(r.get("completion"), str) and r["completion"]]
        skipped = len(rows) - len(texts)
        if not texts:
            _fail(f"{add}: no rows with a non-empty 'completion' string")
    m, tok = _load(model, NO_HEADS, "auto")  # (only the fingerprint is read: any dtype gives it)
    fp = backbone_fingerprint(m.backbone, tok)
    store = AnswerStore(answers_path(fp, cache_dir()), fp["tokenizer"])
    try:
        if clear:
            typer.echo(f"{store.path}: {'cleared' if store.clear() else 'nothing stored'}")
            return
        if texts is not None:
            seqs = [s for s in (tok.encode(t, add_special_tokens=False) for t in texts) if s]
            store.append(seqs)
            note = f" ({skipped} rows without a completion skipped)" if skipped else ""
            typer.echo(f"{store.path}: added {len(seqs)} answers, {sum(map(len, seqs))} tokens{note}")
        tokens = store.read()
    except OSError as e:
        _fail(f"{store.path}: {e}")
    count = int((tokens == SEP).sum())
    size = store.path.stat().st_size if store.path.is_file() else 0
    typer.echo(
        f"{store.path}: {count} answers, {len(tokens) - count} tokens ({size / 1e6:.2f} MB; keeps the "
        f"latest {store.max_tokens} tokens)"
    )


@app.command("eval-heads")
def eval_heads(
    model: str = _MODEL,
    heads: str = _HEADS,
    prompts: str = typer.Option(
        "spec-bench",
        "--prompts",
        help="A Spec-Bench question.jsonl, or 'spec-bench' for the copy shipped with the package.",
    ),
    per_group: int | None = typer.Option(
        None, *_PER_GROUP, help="First N questions of each task group (category)."
    ),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    tree: str | None = _TREE,
    prompt_lookup: int | None = _LOOKUP,
    dtype: str = _DTYPE,
    out: str | None = typer.Option(None, "--out", help="Write the result as JSON to this file."),
    workers: int = typer.Option(
        1,
        "--workers",
        help="Ranks to start on this machine (2 suits a 2-core CPU); under mlx.launch, the launcher's.",
    ),
    replay: bool = typer.Option(
        False,
        "--replay",
        help="Batched greedy generation, then the loop's drafting and acceptance replayed over it "
        "(same tau, several times faster; heads that read only the final hidden state).",
    ),
):
    """Greedy decoding over Spec-Bench first turns: tau overall, per task group and per category.
    Under mlx.launch the prompts are split over the ranks and rank 0 reports.

    Guide: docs/heads.md (results: docs/benchmarks.md)
    """
    from mlx_stream.bench import (
        Decoding,
        decode_items_in_processes,
        decode_items_over_ranks,
        pool_tau,
        tau_by_category,
    )
    from mlx_stream.distributed import connect, launched
    from mlx_stream.files import write_json
    from mlx_stream.generate import check_generation
    from mlx_stream.prompts import load_spec_bench

    decoding = Decoding(max_tokens, tree, prompt_lookup)
    try:
        check_generation(max_tokens, 0.0, tree=tree, prompt_lookup=prompt_lookup)
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        if replay and workers > 1:
            raise ValueError(
                "--replay runs in one process (its generation is batched); start ranks with mlx.launch "
                "instead of --workers"
            )
        items = load_spec_bench(None if prompts == "spec-bench" else prompts, per_group)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if out:
        _check_out(out, folder=False)
    m, tok = _load(model, heads, dtype)
    if m.heads is None:
        typer.echo("note: no heads loaded; tau will be 1.0", err=True)
    if replay:
        from mlx_stream.train.replay import replay_items

        done = []

        def _progress(row):
            done.append(row)
            if len(done) % 20 == 0 or len(done) == len(items):
                tau = pool_tau(done).get("all", {}).get("tau", float("nan"))
                typer.echo(f"{len(done)}/{len(items)}  tau so far {tau:.3f}", err=True)

        def _replay(its):
            return replay_items(m, tok, its, max_tokens, tree, prompt_lookup, progress=_progress)

        try:
            ranks = connect()  # under mlx.launch the ranks split the prompts
            res = pool_tau(ranks.map(_replay, items))
        except ValueError as e:
            _fail(str(e))
        if not ranks.is_main:
            return
    elif launched():
        ranks = connect()
        res = pool_tau(decode_items_over_ranks(m, tok, items, decoding, ranks))
        if not ranks.is_main:
            return
    elif workers > 1:
        spec = heads if m.heads is not None else None  # each process resolves it as load did
        del m, tok
        try:
            res = pool_tau(decode_items_in_processes(model, spec, dtype, items, decoding, workers))
        except RuntimeError as e:
            _fail(str(e))
    else:
        res = tau_by_category(
            m,
            tok,
            items,
            decoding,
            progress=lambda k, s: typer.echo(f"{k}/{len(items)}  tau so far {s['tau']:.3f}", err=True),
        )
    for key, v in res.items():
        typer.echo(f"{key:28s} tau {v['tau']:.3f}  ({v['prompts']} prompts)")
    if out:
        write_json(res, out)


def main() -> None:
    """The ``mlx-stream`` console command: on Linux, first re-executed once with OpenBLAS
    preloaded where it is installed and MLX would otherwise use the slow reference BLAS."""
    from mlx_stream.env import reexec_with_openblas

    reexec_with_openblas()
    warnings.showwarning = _one_line_warning
    app()


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    typer.echo(f"warning: {message}", err=True)


if __name__ == "__main__":
    main()
