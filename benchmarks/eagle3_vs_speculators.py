"""Our EAGLE-3 layer and tests/test_eagle3.py's torch reference against vLLM speculators'
own ``Eagle3DraftModel`` (0.9.0): the first drafting step's logits at every prompt position,
for tiny checkpoints in the speculators and SafeAILab layouts written by the tests.

speculators pulls in datasets, torchvision and more; it need not be installed in the
project's environment (torch and transformers are), e.g.::

    pip install --no-deps --target /tmp/spec speculators==0.9.0 hs-connectors==0.9.0 loguru pydantic-settings
    pip install --target /tmp/spec-deps datasets
    PYTHONPATH=/tmp/spec SPEC_DEPS=/tmp/spec-deps python benchmarks/eagle3_vs_speculators.py
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
            f"{layout}: max |dlogit| over {len(ids)} positions (logits up to {np.abs(sl).max():.1f}): "
            f"speculators vs ours {np.abs(sl - ours).max():.1e}, speculators vs the tests' torch "
            f"reference {np.abs(sl - tl.numpy()).max():.1e}; "
            f"argmax equal: {(sl.argmax(-1) == ours.argmax(-1)).all()}"
        )


if __name__ == "__main__":
    main()
