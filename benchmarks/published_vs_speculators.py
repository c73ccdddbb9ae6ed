"""Our published-drafter layers and the tests' torch references against vLLM speculators'
own code (0.9.0), once, on the tests' tiny checkpoints: EAGLE-3 (``Eagle3DraftModel``: the
first drafting step's logits at every prompt position, speculators and SafeAILab layouts)
and DFlash (its ``Qwen3DFlashDecoderLayer``: a block's logits over a prompt's context,
z-lab and speculators layouts).

speculators pulls in datasets, torchvision and more; it need not be installed in the
project's environment (torch and transformers are), e.g.::

    pip install --no-deps --target /tmp/spec speculators==0.9.0 hs-connectors==0.9.0 loguru pydantic-settings
    pip install --target /tmp/spec-deps datasets
    PYTHONPATH=/tmp/spec SPEC_DEPS=/tmp/spec-deps python benchmarks/published_vs_speculators.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
if os.environ.get("SPEC_DEPS"):
    sys.path.append(os.environ["SPEC_DEPS"])  # after the project's own packages

LAYER_KEYS = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "num_hidden_layers",
)
SPEC_CONFIG = {
    "algorithm": "eagle3",
    "proposal_methods": [{"proposal_type": "greedy"}],
    "default_proposal_method": "greedy",
    "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
}


def speculators_logits(ref, aux, nxt):
    """speculators' own modules over P entries, as its forward runs TTT step 0."""
    from transformers import DynamicCache

    P = aux.shape[1]
    with torch.no_grad():
        x = aux
        if ref.fc_norm is not None:
            x = torch.cat([n(c) for n, c in zip(ref.fc_norm, x.chunk(len(ref.fc_norm), -1))], -1)
        x = ref.fc(x)
        pos = 1 + torch.arange(P)[None]  # (its positions start at 1; rotary is relative)
        mask = ref._build_attn_mask(torch.zeros(P, dtype=torch.long), P, "cpu")
        h = torch.cat([ref.embed_tokens(torch.tensor([nxt])), x], -1)
        y = ref.layers[0](
            h,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=DynamicCache(),
            cache_position=torch.arange(P),
            position_embeddings=ref.rotary_emb(h, pos),
        )
        y = y[0] if isinstance(y, tuple) else y
        return ref.lm_head(ref.norm(y))[0].numpy()


def dflash(root, td) -> None:
    import test_dflash as D
    from speculators.models.dflash.model_definitions import Qwen3DFlashDecoderLayer
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

    from mlx_stream import load
    from mlx_stream.cache import make_tree_cache
    from mlx_stream.drafters.dflash import DFlashDrafter
    from mlx_stream.tree import chain

    plain, tok = load(str(td), heads=None, dtype="float32")
    V = plain.args.vocab_size
    for layout in ("z-lab", "speculators"):
        path, W = D.write_dflash(root / f"df-{layout}", layout, V, seed=3)
        model, tok = load(str(td), heads=str(path), dtype="float32")
        aux = list(model.heads.config.fuse_layers)
        ids = tok.encode("The quick brown fox jumps over the lazy dog")
        h, mids = model.family.prefill_hidden(
            model.backbone, mx.array(ids), make_tree_cache(model.backbone), aux
        )
        r = len(ids) - 1  # the root at r, the context positions 0..r-1
        drafter = DFlashDrafter(model, chain(D.BLOCK - 1))
        seen, real = [], drafter._logits
        drafter._logits = lambda out, real=real, seen=seen: seen.append(real(out)) or seen[-1]
        drafter.draft(mx.concatenate([h, mids], -1)[:r], ids)
        ours = np.array(seen[-1])
        cfg = Qwen3Config(
            hidden_size=D.H,
            num_attention_heads=D.HEADS,
            num_key_value_heads=D.KV,
            head_dim=D.HD,
            intermediate_size=D.FF,
            rms_norm_eps=1e-6,
            rope_theta=D.THETA,
            vocab_size=V,
            num_hidden_layers=D.N_LAYERS,
        )
        cfg._attn_implementation = "eager"
        layers = [Qwen3DFlashDecoderLayer(cfg, i).eval() for i in range(D.N_LAYERS)]
        for i, layer in enumerate(layers):
            layer.load_state_dict(
                {k[len(f"layers.{i}.") :]: v for k, v in W.items() if k.startswith(f"layers.{i}.")}
            )
        hidden_norm, norm = Qwen3RMSNorm(D.H, eps=1e-6), Qwen3RMSNorm(D.H, eps=1e-6)
        hidden_norm.weight.data, norm.weight.data = W["hidden_norm.weight"], W["norm.weight"]
        emb = torch.from_numpy(np.array(model.backbone.model.embed_tokens.weight))
        head = W.get("lm_head.weight", torch.from_numpy(np.array(model.backbone.lm_head.weight)))
        with torch.no_grad():
            c = hidden_norm(torch.from_numpy(np.array(mids[:r])) @ W["fc.weight"].T)[None]
            x = emb[torch.tensor([ids[r]] + [D.MASK] * (D.BLOCK - 1))][None]
            pe = Qwen3RotaryEmbedding(cfg)(x, torch.arange(r + D.BLOCK)[None])
            for layer in layers:
                x = layer(target_hidden=c, hidden_states=x, attention_mask=None, position_embeddings=pe)
            sl = (norm(x[0, 1:]) @ head.T).numpy()
        print(
            f"DFlash {layout}: max |dlogit| over {D.BLOCK - 1} block positions (logits up to "
            f"{np.abs(sl).max():.1f}): speculators' layers vs ours {np.abs(sl - ours).max():.1e}; "
            f"argmax equal: {(sl.argmax(-1) == ours.argmax(-1)).all()}"
        )


def main() -> None:
    import test_eagle3 as T
    from conftest import make_tiny_model_dir
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from mlx_stream import load
    from mlx_stream.cache import make_tree_cache

    root = Path(tempfile.mkdtemp())
    td = make_tiny_model_dir(root / "t", layers=T.L_TARGET, tied=False)
    model, tok = load(str(td), heads=None, dtype="float32")
    V = model.args.vocab_size
    for layout in ("speculators", "eagle"):
        path, W, cfg = T.write_eagle3(root / layout, layout, V, seed=3)
        model, tok = load(str(td), heads=str(path), dtype="float32")
        aux = list(model.heads.config.fuse_layers)
        spec_style = layout == "speculators"
        layer = cfg["transformer_layer_config"] if spec_style else {k: cfg[k] for k in LAYER_KEYS}
        sc = Eagle3SpeculatorConfig(
            transformer_layer_config=dict(layer),
            draft_vocab_size=cfg["draft_vocab_size"],
            norm_before_residual=cfg.get("norm_before_residual", False),
            fc_norm=cfg.get("fc_norm", False),
            eagle_aux_hidden_state_layer_ids=aux,
            speculators_config=SPEC_CONFIG,
        )
        sc.transformer_layer_config._attn_implementation = "eager"
        ref = Eagle3DraftModel(sc).float().eval()
        sd = {k.replace("midlayer.", "layers.0."): v for k, v in W.items()}
        sd["embed_tokens.weight"] = torch.from_numpy(np.array(model.backbone.model.embed_tokens.weight))
        missing, unexpected = ref.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}
        ids = tok.encode("The quick brown fox jumps over")
        cache = make_tree_cache(model.backbone)
        h, mids = model.family.prefill_hidden(model.backbone, mx.array(ids), cache, aux)
        nxt = ids[1:] + [int(mx.argmax(model.project(h[-1])).item())]  # x_{i+1} of each entry, the root last
        feats = mx.concatenate([h, mids], -1)
        layer3 = model.heads.eagle
        ours = np.array(layer3.logits(layer3.sequence(feats[None], model.embed(mx.array(nxt))[None]))[0])
        aux_t = torch.from_numpy(np.array(mids))[None]
        tr = T.TorchEagle3(W, cfg)
        emb = torch.from_numpy(np.array(model.backbone.model.embed_tokens.weight))
        _, tl = tr.step(tr.fc(aux_t[0]), torch.tensor(nxt), emb, torch.arange(len(ids)))
        sl = speculators_logits(ref, aux_t, nxt)
        print(
            f"EAGLE-3 {layout}: max |dlogit| over {len(ids)} positions "
            f"(logits up to {np.abs(sl).max():.1f}): "
            f"speculators vs ours {np.abs(sl - ours).max():.1e}, speculators vs the tests' torch "
            f"reference {np.abs(sl - tl.numpy()).max():.1e}; "
            f"argmax equal: {(sl.argmax(-1) == ours.argmax(-1)).all()}"
        )
    dflash(root, td)


if __name__ == "__main__":
    main()
