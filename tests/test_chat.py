"""Multi-turn chat (ChatSession, what `mlx-stream chat` runs): the cache is the transcript."""

import pytest
from helpers import ours

from mlx_stream import ChatSession
from mlx_stream.heads import new_heads

TURNS = ["The quick brown fox", "heads, trees!", "0123 café and more"]


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=tok.bos_token is None or not text.startswith(tok.bos_token))


@pytest.mark.parametrize("heads", [False, True])
def test_cache_holds_the_retokenised_transcript_and_replies_equal_cold_runs(tiny, heads):
    model, tok = tiny
    if heads:
        model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=5, architecture="hydra")
    chat = ChatSession(model, tok, system="be brief", max_tokens=12)
    for turn in TURNS:
        chat.messages.append({"role": "user", "content": turn})
        prompt = chat.prompt()
        chat.messages.pop()
        rs = list(chat.send(turn))
        got = [t for r in rs for t in r.tokens]
        ids = _ids(tok, prompt)
        # the cache holds this turn's whole transcript, re-tokenised, then the reply; the last
        # token emitted (the reply's last, or the EOS) is the next step's root, not yet cached
        full = ids + got + ([tok.eos_token_id] if rs[-1].finish_reason == "stop" else [])
        n = len(chat.cache.tokens)
        assert chat.cache.tokens == full[:n] and n >= len(full) - 1
        cold, _ = ours(model, tok, prompt, 12)
        assert got == cold
        assert chat.messages[-1] == {"role": "assistant", "content": tok.decode(got)}
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * len(TURNS)
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "be brief"}] and chat.cache.tokens == []


def test_stopping_early_or_interrupting_keeps_the_session_usable(tiny):
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=5, architecture="hydra")
    chat = ChatSession(model, tok, max_tokens=16)
    first = next(iter(chat.send(TURNS[0])))  # the caller stops after the first chunk
    assert chat.messages[-1] == {"role": "assistant", "content": first.text}
    got = [t for r in chat.send(TURNS[1]) for t in r.tokens]
    assert got == ours(model, tok, _prompt_before_last_reply(chat), 16)[0]

    calls = {"n": 0}

    def interrupt(tokens, logits):  # Ctrl-C in the middle of a decoding step
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return logits

    with pytest.raises(KeyboardInterrupt):
        for _ in chat.send(TURNS[2], logits_processors=[interrupt]):
            pass
    assert chat.cache.tokens == []  # a step may have been cut in half: the cache starts over
    got = [t for r in chat.send("again") for t in r.tokens]
    assert got == ours(model, tok, _prompt_before_last_reply(chat), 16)[0]


def test_a_turn_that_does_not_fit_is_refused_and_forgotten(tiny):
    model, tok = tiny
    chat = ChatSession(model, tok, max_tokens=8)
    list(chat.send(TURNS[0]))
    before = list(chat.messages)
    with pytest.raises(ValueError, match="context window"):
        list(chat.send("fox " * 600))
    assert chat.messages == before
    got = [t for r in chat.send(TURNS[1]) for t in r.tokens]
    assert got == ours(model, tok, _prompt_before_last_reply(chat), 8)[0]


def test_a_model_without_chat_template_is_refused(tiny):
    model, tok = tiny
    template, tok._tokenizer.chat_template = tok._tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="chat template"):
            ChatSession(model, tok)
    finally:
        tok._tokenizer.chat_template = template


def _prompt_before_last_reply(chat):
    msgs = chat.messages[:-1]
    return chat.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_a_reply_left_unfinished_is_settled_by_the_next_turn_and_reset(tiny):
    """Issue 48: a caller that stops iterating without closing the stream; the next send
    (and reset) closes it first, so the transcript alternates and nothing stale lands later."""
    import gc

    model, tok = tiny
    chat = ChatSession(model, tok, max_tokens=16)
    it = chat.send(TURNS[0])
    first = [next(it).text for _ in range(3)]  # stopped after 3 chunks, `it` still alive
    got = [t for r in chat.send(TURNS[1]) for t in r.tokens]
    roles = [m["role"] for m in chat.messages]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert chat.messages[1]["content"] == "".join(first)  # the stopped reply joined in its place
    assert got == ours(model, tok, _prompt_before_last_reply(chat), 16)[0]  # as a cold run
    del it
    gc.collect()
    assert [m["role"] for m in chat.messages] == roles  # nothing appended after collection
    it = chat.send(TURNS[2])
    next(it)
    chat.reset()
    assert chat.messages == [] and chat.cache.tokens == []
    assert list(it) == []  # settled: the stream is over
    del it
    gc.collect()
    assert chat.messages == []


def test_text_that_is_not_unicode_is_refused_at_the_call(tiny):
    """Issue 48: lone surrogates (bytes that were not UTF-8) are refused with a ValueError
    that says so, before the turn joins the transcript, not a tokenizer TypeError."""
    model, tok = tiny
    chat = ChatSession(model, tok, max_tokens=4)
    with pytest.raises(ValueError, match="not valid Unicode"):
        chat.send("hi \udcff")
    assert chat.messages == []
    with pytest.raises(ValueError, match="system prompt is not valid Unicode"):
        ChatSession(model, tok, system="be \udcfe brief")
