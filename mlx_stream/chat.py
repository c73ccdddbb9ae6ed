"""A multi-turn chat whose KV cache persists across turns (what ``mlx-stream chat`` runs)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator

from .checks import kind, require_tokenizer, require_unicode
from .generate import GenerationResponse, PromptCache, check_generation, stream_generate
from .model import require_model
from .sampling import SamplingParams


class ChatSession:
    """A conversation with a model: each turn's prompt is the whole transcript through the
    chat template, and the KV cache keeps what the previous turns already computed.

    Every turn re-tokenises the whole transcript (end-of-turn tokens included) and reuses
    the cache only up to its longest common prefix with it (:meth:`PromptCache.reuse`), so
    a reply is exactly what a cold start on the same transcript would give, even where
    re-tokenising a reply's text gives other tokens than were generated.

    Args:
        model, tokenizer: from :func:`mlx_stream.load`; the tokenizer needs a chat template.
        system: an optional system prompt.
        **generation: keyword arguments for :func:`mlx_stream.stream_generate`
            (``max_tokens``, ``temp``, ``tree``, ``seed``, ...), used by every turn.

    Attributes:
        messages: the transcript (``{"role", "content"}`` dicts).
        cache: the :class:`~mlx_stream.generate.PromptCache`.

    Raises:
        TypeError: a model or tokenizer not from :func:`mlx_stream.load`, or an unknown
            generation argument.
        ValueError: the tokenizer has no chat template, or a generation setting out of range.
    """

    def __init__(self, model, tokenizer, system: str | None = None, **generation):
        require_model(model)
        require_tokenizer(tokenizer)
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, got {kind(system)}")
        if system is not None:
            require_unicode(system, "the system prompt")
        known = set(inspect.signature(stream_generate).parameters) - {"model", "tokenizer", "prompt"}
        unknown = sorted(set(generation) - known - {"prompt_cache"})
        if unknown or "prompt_cache" in generation:
            takes = ", ".join(sorted(known - {"prompt_cache"}))
            raise TypeError(
                f"ChatSession: unknown generation argument {(unknown or ['prompt_cache'])[0]!r} (the "
                f"session owns its prompt cache); it takes stream_generate's: {takes}"
            )
        sampling = ("temp", "top_p", "top_k", "min_p", "min_tokens_to_keep")
        check_generation(  # every turn's settings, checked once, before the first turn
            generation.get("max_tokens", 256),
            SamplingParams(**{k: generation[k] for k in sampling if k in generation}),
            model.args.vocab_size,
            tree=generation.get("tree"),
            prompt_lookup=generation.get("prompt_lookup"),
        )
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; use generate with raw text instead")
        self.model, self.tokenizer, self.generation = model, tokenizer, generation
        self.base = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict] = list(self.base)
        self.cache = PromptCache(model, generation.get("max_kv_size"))
        # the reply being streamed, settled before the next turn; a weak reference, so a
        # stream the caller dropped is closed (and joins the transcript) as soon as it is freed
        self._turn: weakref.ref | None = None

    def prompt(self) -> str:
        """The transcript through the chat template, ready for the assistant's turn."""
        return self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)

    def send(self, text: str, **overrides) -> Iterator[GenerationResponse]:
        """Add a user turn and stream the reply; the reply joins the transcript when the
        stream ends, also when the caller stops early (what was streamed is kept).

        A reply the caller stopped iterating without closing it is settled (closed, its
        streamed part joining the transcript) by the next :meth:`send` or :meth:`reset`,
        so the transcript always alternates user and assistant turns.

        A ``KeyboardInterrupt`` inside a decoding step (which may leave the cache half
        updated) clears the cache before it propagates; the next turn recomputes it.
        A ``ValueError`` (bad parameters, a transcript longer than the context window)
        removes the user turn again before it propagates.

        Raises:
            TypeError: ``text`` is not a str (at the call, before any iteration).
            ValueError: ``text`` is not valid Unicode (at the call); see above.
        """
        if not isinstance(text, str):
            raise TypeError(f"a chat turn's text must be a str, got {kind(text)}")
        require_unicode(text, "a chat turn's text")
        self._settle()
        turn = self._reply(text, overrides)
        self._turn = weakref.ref(turn)
        return turn

    def _settle(self) -> None:
        # closing a suspended reply runs its `finally`: the part streamed joins the transcript
        turn = self._turn() if self._turn is not None else None
        if turn is not None:
            turn.close()
        self._turn = None

    def _reply(self, text: str, overrides: dict) -> Iterator[GenerationResponse]:
        self.messages.append({"role": "user", "content": text})
        reply: list[str] = []
        failed = False
        try:
            for r in stream_generate(
                self.model,
                self.tokenizer,
                self.prompt(),
                prompt_cache=self.cache,
                **(self.generation | overrides),
            ):
                reply.append(r.text)
                yield r
        except ValueError:
            self.messages.pop()
            failed = True
            raise
        except KeyboardInterrupt:
            self.cache.reset()
            raise
        finally:
            if not failed:
                self.messages.append({"role": "assistant", "content": "".join(reply)})

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and clear the cache."""
        self._settle()
        self.messages = list(self.base)
        self.cache.reset()
