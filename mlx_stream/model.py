"""The backbone with its stream heads attached."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .checks import kind
from .models import family, text_args


class SpeculativeModel(nn.Module):
    """An mlx-lm backbone plus optional stream heads.

    It is called like the backbone (``model(inputs, cache=...)`` returns logits of
    shape ``(B, L, V)``), exposes ``layers`` and ``make_cache``, so plain mlx-lm
    functions such as ``mlx_lm.generate`` accept it and run the same weights.

    Attributes:
        backbone: the mlx-lm ``Model`` (frozen during head training).
        heads: a :class:`mlx_stream.heads.StreamHeads` or ``None`` (plain decoding).
        family: the tree-forward module of the backbone's architecture.
        datastore: the :class:`~mlx_stream.datastore.DraftStore` of past answers that
            prompt lookup's chains also draft from, or ``None``
            (:func:`mlx_stream.loader.load` sets it).
        draft_model: a :class:`~mlx_stream.drafters.draft_model.DraftModel` that drafts instead
            of the heads, or ``None`` (``load(..., draft_model=)`` sets it).

    Raises:
        TypeError: ``backbone`` is not an mlx-lm model, or ``heads`` not a module.
        ValueError: a model whose arguments name no ``vocab_size`` (mlx-lm's ``phixtral``).
    """

    def __init__(self, backbone: nn.Module, heads: nn.Module | None = None):
        if (
            not isinstance(backbone, nn.Module)
            or not (hasattr(backbone, "args") or hasattr(backbone, "config"))
            or isinstance(backbone, SpeculativeModel)
        ):
            raise TypeError(
                "backbone must be an mlx-lm model (model, tokenizer = mlx_lm.load(...)); a model from "
                f"mlx_stream.load is already a SpeculativeModel; got {type(backbone).__name__}"
            )
        if heads is not None and not isinstance(heads, nn.Module):
            raise TypeError(
                f"heads must be StreamHeads (mlx_stream.heads.load_heads) or None, got {type(heads).__name__}"
            )
        super().__init__()
        self.backbone = backbone
        self.heads = heads
        if not hasattr(text_args(backbone), "vocab_size"):
            raise ValueError(
                f"{type(backbone).__module__}: its arguments give no vocab_size (another name for it), "
                "which decoding reads: not supported"
            )
        self.family = family(backbone)
        self.datastore = None
        self.draft_model = None

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        return self.backbone(inputs, cache=cache, **kwargs)

    @property
    def layers(self):
        return self.backbone.layers

    @property
    def model_type(self) -> str:
        return self.backbone.model_type

    @property
    def args(self):
        return text_args(self.backbone)

    def make_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.backbone)

    @property
    def state_size(self) -> int:
        """Width of the hidden states the heads read (the output projection's input)."""
        return self.family.state_size(self.backbone)

    @property
    def context_length(self) -> int | None:
        """The backbone's context window in tokens (``max_position_embeddings``), if known."""
        n = getattr(self.args, "max_position_embeddings", None)
        return int(n) if n else None

    def embed(self, tokens: mx.array) -> mx.array:
        """The backbone's (frozen) input embeddings: int ``(...)`` -> float32 ``(..., H)``."""
        return self.family.embed(self.backbone, tokens).astype(mx.float32)

    def project(self, hidden: mx.array, rows: mx.array | None = None) -> mx.array:
        """Logits of head outputs ``(..., H)`` through the frozen output projection, or only
        its ``rows`` ``(V', H)`` (a reduced draft vocabulary): ``(..., V)`` or ``(..., V')``."""
        return self.family.project(self.backbone, hidden) if rows is None else hidden @ rows.T

    def head_logits(
        self, hidden: mx.array, rows: mx.array | None = None, path: mx.array | None = None
    ) -> mx.array:
        """Stream-head logits at hidden states: ``(..., H)`` -> ``(K, ..., V)``.

        Args:
            rows: ``(V', H)`` output-projection rows to score (a reduced draft
                vocabulary); ``None`` uses the backbone's whole output projection.
            path: int ``(..., K)`` tokens ``x_{t+1..t+K}`` on the path (needed by
                path-conditioned "hydra" heads; ignored by residual heads).

        Raises:
            ValueError: no heads are attached, or hydra heads without ``path``.
        """
        if self.heads is None:
            raise ValueError("no stream heads attached: load the model with heads=...")
        if self.heads.attends:
            raise ValueError("msa heads read the top layers' input and the KV cache: use stream_logits")
        emb = self.embed(path) if path is not None and self.heads.conditioned else None
        return self.project(self.heads(hidden, emb), rows)

    def stream_logits(self, mid: mx.array, root: int, cache, rows: mx.array | None = None) -> mx.array:
        """Multi-stream attention ("msa") heads' logits at the cache's last position t.

        Args:
            mid: ``(H,)`` the hidden state entering layer L - N_s at position t.
            root: the token x_{t+1} (the backbone's own prediction at t).
            cache: per layer, a KV cache holding positions 0..t (read, not changed).
            rows: as in :meth:`head_logits`.

        Returns:
            ``(K, V)`` (or ``(K, V')``): stream j's logits for token t+1+j.

        Raises:
            ValueError: no heads, or heads that are not "msa".
        """
        if self.heads is None or not self.heads.attends:
            raise ValueError("stream_logits needs msa heads")
        ns = self.heads.config.stream_layers
        t = cache[0].offset - 1
        kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache[-ns:]]
        x = mid.reshape(1, 1, -1)
        s = self.family.stream_hidden(
            self.backbone,
            self.heads,
            x,
            mx.array([[t]]),
            kv,
            mx.ones((1, 1, t + 1), dtype=mx.bool_),
            mx.array([[root]], dtype=mx.int32),
        )  # (K, 1, 1, H)
        return self.project(self.heads(s)[:, 0, 0], rows)


def require_model(model, name: str = "model") -> None:
    """``model`` must be a :class:`~mlx_stream.model.SpeculativeModel`.

    Raises:
        TypeError: anything else, naming what to pass instead.
    """
    if not isinstance(model, SpeculativeModel):
        raise TypeError(
            f"{name} must be the SpeculativeModel that mlx_stream.load returns (model, tokenizer = "
            f"mlx_stream.load(SPEC)), or an mlx-lm model wrapped as mlx_stream.SpeculativeModel(m); "
            f"got {kind(model)}"
        )
