"""A multi-turn chat whose KV cache persists across turns (what ``mlx-stream chat`` runs)."""

from __future__ import annotations

from collections.abc import Iterator

from .generate import GenerationResponse, PromptCache, stream_generate


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
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, model, tokenizer, system: str | None = None, **generation):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; use generate with raw text instead")
        self.model, self.tokenizer, self.generation = model, tokenizer, generation
        self.base = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict] = list(self.base)
        self.cache = PromptCache(model, generation.get("max_kv_size"))

    def prompt(self) -> str:
        """The transcript through the chat template, ready for the assistant's turn."""
        return self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)

    def send(self, text: str, **overrides) -> Iterator[GenerationResponse]:
        """Add a user turn and stream the reply; the reply joins the transcript when the
        stream ends, also when the caller stops early (what was streamed is kept).

        A ``KeyboardInterrupt`` inside a decoding step (which may leave the cache half
        updated) clears the cache before it propagates; the next turn recomputes it.
        A ``ValueError`` (bad parameters, a transcript longer than the context window)
        removes the user turn again before it propagates.
        """
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
        self.messages = list(self.base)
        self.cache.reset()
