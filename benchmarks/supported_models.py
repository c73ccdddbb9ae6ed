"""Which mlx-lm model types mlx-stream runs, and how: a tiny random model of every type in
the installed mlx-lm, built from its own ``ModelArgs``/``Model`` classes (no weights), put
through the checks of ``tests/test_any_model.py``. Writes the table to
docs/supported_models.md (and the rows as JSON beside it).

    python benchmarks/supported_models.py            # every type (~5 min on 2 CPU cores)
    python benchmarks/supported_models.py llama gpt2 # some

Columns: **plain** greedy decoding through our loop equals plain ``mlx_lm.stream_generate``;
**chains**: a chain of 3 accepted in part (the target's own continuation, every third token
wrong), greedy, equals mlx-lm; **trees**: the load-time self-check found a draft tree's
logits equal to sequential ones (recurrent hybrids: also the state kept for a path, read on)
and then a tree drafted by the target itself (hybrids: the partly wrong oracle), greedy,
equals mlx-lm; **draft model**: a perturbed copy drafting a chain of 3, greedy, equals
mlx-lm; **heads**: fresh random stream heads drafting a tree, greedy, equals mlx-lm;
**eagle**: a fresh EAGLE-3-style draft layer over the final state and two lower layers'
inputs, drafting a dynamic tree, greedy, equals mlx-lm; **sampling**: seeded sampling
(T = 0.7) with prompt lookup and the drafted tree equals seeded plain sampling. 24 tokens past a
sliding window of 4 where the model has one. "-": not reached (an earlier column failed).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import make_tiny_model_dir  # noqa: E402
from helpers import SelfDrafter, mlx_lm_greedy, ours, top2_gap  # noqa: E402
from mlx.utils import tree_map  # noqa: E402

TOKENS = 24
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"

# tiny settings under the names mlx-lm's ModelArgs use; a type's own required fields beyond
# these are what the "built" column reports missing
TINY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    layer_norm_eps=1e-5,
    norm_eps=1e-5,
    norm_epsilon=1e-5,
    layer_norm_epsilon=1e-5,
    head_dim=16,
    max_position_embeddings=4096,
    rope_theta=1e4,
    tie_word_embeddings=False,
    n_embd=64,
    n_head=4,
    n_layer=3,
    n_positions=4096,
    n_ctx=4096,
    d_model=64,
    n_heads=4,
    n_layers=3,
    dim=64,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=8,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    sliding_window=4,
    sliding_window_size=4,
    attention_window_size=4,
    sliding_window_pattern=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    query_pre_attn_scalar=16,
    num_kv_shared_layers=1,
    global_head_dim=32,
    hidden_size_per_layer_input=16,
    attention_bias=False,
    mlp_bias=False,
    vocab_size_per_layer_input=None,  # filled with the vocabulary
    # names other types use for the same things
    hidden_dim=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    n_kv_heads=2,
    num_query_heads=4,
    model_dim=64,
    num_shared_experts=1,
    num_shared_expert=1,
    moe_num_experts=4,
    moe_topk=2,
    routed_scaling_factor=1.0,
    partial_rotary_factor=0.5,
    rotary_pct=0.5,
    rotary_emb_base=1e4,
    rotary_dim=8,
    rope_scaling=None,
    use_qk_norm=True,
    qk_norm=True,
    post_norm=False,
    use_bias=False,
    use_qkv_bias=False,
    n_inner=128,
    hidden_act="silu",
    ffn_hidden_size=128,
    expert_ffn_hidden_size=32,
    shared_intermediate_size=32,
    intermediate_size_mlp=128,
    no_rope_layers=[1, 1, 0],
    logits_scaling=2.0,
    attention_multiplier=0.25,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    dim_model_base=32,
    scale_depth=1.0,
    scale_emb=2.0,
    num_attention_groups=2,
    # recurrent layers (issue 52: chains on hybrids)
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    linear_allow_neg_eigval=False,
    full_attention_interval=2,
    state_size=16,
    ssm_state_size=16,
    conv_kernel=4,
    use_conv_bias=True,
    time_step_rank=8,
    time_step_limit=(0.0, float("inf")),
    n_groups=1,
    mamba_num_heads=4,
    mamba_head_dim=16,
    mamba_proj_bias=False,
    mamba_d_conv=4,
    mamba_d_state=16,
    mamba_expand=2,
    conv_bias=False,
    conv_L_cache=3,
    block_dim=64,
    block_multiple_of=16,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False,
)


# a type's own layer stack, where its ModelArgs need one spelled out
LAYER_STACKS = {
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"]},
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention", "conv"],
        "use_expert_bias": False,
        "num_dense_layers": 1,
    },
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention", "mamba"],
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
    }
    | {"mamba_n_groups": 1, "mamba_conv_bias": True, "mamba_proj_bias": False},
    "nemotron_h": {"hybrid_override_pattern": ["M", "*", "M"]},
}


def model_types() -> list[str]:
    import mlx_lm.models as pkg

    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            mod = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (ImportError, SystemExit):  # a type whose module needs another package
            continue
        if hasattr(mod, "Model") and hasattr(mod, "ModelArgs"):
            out.append(info.name)
    return out


def build(model_type: str, vocab: int, seed: int = 0, noise: float = 0.0):
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    cfg = dict(TINY, model_type=model_type, vocab_size=vocab, vocab_size_per_layer_input=vocab)
    cfg |= LAYER_STACKS.get(model_type, {})
    cfg["text_config"] = dict(cfg)  # vision-language wrappers: the text model's settings
    args = mod.ModelArgs.from_dict(cfg)
    mx.random.seed(seed)
    model = mod.Model(args)
    # 4x mlx-lm's initialisation, as the tests: no near-ties between the top logits; vectors
    # (gains, biases, gates) moved off their initial 0 or 1, which can make a random model
    # blind to positions
    model.update(
        tree_map(lambda p: p * 4 if p.ndim == 2 else p + 0.05 * mx.random.normal(p.shape), model.parameters())
    )
    if noise:
        mx.random.seed(seed + 1)
        model.update(
            tree_map(
                lambda p: p + noise * mx.random.normal(p.shape) if p.ndim == 2 else p, model.parameters()
            )
        )
    mx.eval(model.parameters())
    return model


def same(model, ids, got, ref) -> bool:
    # token for token; a first difference only at a near-tie (tests/helpers.assert_greedy_identical)
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            return top2_gap(model, list(ids) + ref[:i]) < 1e-4
    return len(got) == len(ref)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def _failed(e: BaseException) -> str:
    # a ValueError is our one-line refusal; anything else is a defect
    return f"refused: {str(e).splitlines()[0]}"[:200] if isinstance(e, ValueError) else f"error: {_short(e)}"


def check(model_type: str, tok) -> dict:
    from mlx_stream import SpeculativeModel, load_draft
    from mlx_stream.drafters import OracleDrafter
    from mlx_stream.heads import new_heads
    from mlx_stream.tree import chain, parse_tree

    row = {"type": model_type}
    vocab = len(tok.vocab)
    try:
        backbone = build(model_type, vocab)
        backbone(mx.array([[1, 2]]))
    except Exception as e:  # noqa: BLE001  a type this sweep cannot build is reported, not fatal
        row["built"] = f"no tiny model: {_short(e)}"
        return row
    row["built"] = "yes"
    try:
        model = SpeculativeModel(backbone)
    except Exception as e:  # noqa: BLE001
        row["plain"] = f"refused: {_short(e)}"
        return row
    ids = tok.encode(PROMPT)
    ref = mlx_lm_greedy(backbone, tok, ids, TOKENS)
    got, _ = ours(model, tok, ids, TOKENS, adaptive=False)
    row["plain"] = "yes" if same(model, ids, got, ref) else "DIFFERS"
    off = getattr(model.family, "trees", None)
    if off is not None:
        row["trees"] = f"off: {off}"
        return row
    # recurrent hybrids: the self-drafter would run their recurrent layers beside the target's,
    # so an oracle drafts for them: the target's own continuation, every 3rd token wrong
    recurrent = getattr(model.family, "recurrent", False)
    wrong = [t if i % 3 != 2 else (t + 1) % vocab for i, t in enumerate(ref)]
    tree = parse_tree("0;1;0,0;0,1;0,0,0", 3)
    got, _ = ours(
        model, tok, ids, TOKENS, drafter=OracleDrafter(len(ids), wrong, chain(3), vocab), adaptive=False
    )
    row["chains"] = "yes" if same(model, ids, got, ref) else "DIFFERS"

    def drafter():
        return OracleDrafter(len(ids), wrong, tree, vocab) if recurrent else SelfDrafter(model, tree)

    got, rs = ours(model, tok, ids, TOKENS, drafter=drafter(), adaptive=False)
    row["trees"] = "yes" if same(model, ids, got, ref) else "DIFFERS"
    try:
        draft = load_draft((build(model_type, vocab, noise=0.01), tok), model, tok, calibrate=False)
        got, _ = ours(model, tok, ids, TOKENS, draft_model=draft, num_draft_tokens=3, adaptive=False)
        row["draft model"] = "yes" if same(model, ids, got, ref) else "DIFFERS"
    except Exception as e:  # noqa: BLE001
        row["draft model"] = _failed(e)
    try:
        heads = SpeculativeModel(backbone, new_heads(backbone, tok, num_heads=3, seed=1, scale=0.02))
        got, _ = ours(heads, tok, ids, TOKENS, tree="0;1;0,0", adaptive=False)
        row["heads"] = "yes" if same(model, ids, got, ref) else "DIFFERS"
    except Exception as e:  # noqa: BLE001
        row["heads"] = _failed(e)
    try:
        eagle = new_heads(backbone, tok, num_heads=3, architecture="eagle", fuse_layers=(0, 1), seed=1)
        got, _ = ours(SpeculativeModel(backbone, eagle), tok, ids, TOKENS, tree="dynamic:6,3", adaptive=False)
        row["eagle"] = "yes" if same(model, ids, got, ref) else "DIFFERS"
    except Exception as e:  # noqa: BLE001
        row["eagle"] = _failed(e)
    plain, _ = ours(model, tok, ids, TOKENS, temp=0.7, seed=5, prompt_lookup=0, adaptive=False)
    drafted, _ = ours(model, tok, ids, TOKENS, temp=0.7, seed=5, drafter=drafter(), adaptive=False)
    looked, _ = ours(model, tok, ids, TOKENS, temp=0.7, seed=5, prompt_lookup=2, adaptive=False)
    row["sampling"] = "yes" if plain == drafted == looked else "DIFFERS"
    return row


COLUMNS = ("plain", "chains", "trees", "draft model", "heads", "eagle", "sampling")


def _split(v: str | None) -> tuple[str, str]:
    # "off: why" -> ("off", "why"); "yes" -> ("yes", "")
    if v is None:
        return "-", ""
    word, _, why = v.partition(": ")
    return word, why


def table(rows: list[dict]) -> str:
    out = ["| model type | " + " | ".join(COLUMNS) + " | why not |", "|---" * (len(COLUMNS) + 2) + "|"]
    for r in rows:
        if r["built"] != "yes":
            why = _split(r["built"])[1].replace("|", "/")
            out.append(
                f"| `{r['type']}` |" + " not checked |" * len(COLUMNS) + f" no tiny model built here: {why} |"
            )
            continue
        cells = [_split(r.get(c)) for c in COLUMNS]
        why = next((w for _, w in cells if w), "").replace("|", "/")
        out.append(f"| `{r['type']}` | " + " | ".join(c for c, _ in cells) + f" | {why} |")
    return "\n".join(out)


def main(argv: list[str]) -> None:
    import mlx_lm

    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as d:
        tok = mlx_lm.load(str(make_tiny_model_dir(Path(d) / "tok")))[1]
    types = argv or model_types()
    rows, tic = [], time.perf_counter()
    for t in types:
        t0 = time.perf_counter()
        try:
            row = check(t, tok)
        except Exception as e:  # noqa: BLE001  one type's failure is its row
            row = {"type": t, "built": "yes", "plain": f"error: {_short(e)}"}
        rows.append(row)
        print(
            f"{t:28s} {time.perf_counter() - t0:5.1f}s  "
            + "  ".join(f"{k}={v}" for k, v in row.items() if k != "type")
        )
    if argv:
        return
    counts = {c: sum(1 for r in rows if r.get(c) == "yes") for c in COLUMNS}
    import mlx_lm as m

    head = (
        f"# Supported models\n\nGenerated by `python benchmarks/supported_models.py` "
        f"({time.strftime('%Y-%m-%d')}, mlx-lm {m.__version__}, {len(rows)} model types, "
        f"{time.perf_counter() - tic:.0f} s): a tiny random model of every mlx-lm model type, from "
        "its own classes, through the checks of `tests/test_any_model.py` (see the script's "
        "docstring for what each column checks). "
        + ", ".join(f"{c}: {n}" for c, n in counts.items())
        + ".\n\n"
    )
    (ROOT / "docs" / "supported_models.md").write_text(head + table(rows) + "\n")
    (ROOT / "benchmarks" / "results" / "supported_models.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
