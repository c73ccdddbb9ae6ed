"""Stop strings cut tokens where they cut text: every substring of several forced outputs
as the stop string, with and without drafts (an oracle drafter makes multi-token steps,
so stops span the boundaries of accepted chunks)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_stream import OracleDrafter, chain, stream_generate

FORCED = ["Hello a b=  x =  1", "naïve café 🙂 ok\n", "line one\n\n  line two\n", "dog dog dog  dog  "]


def _forcer(prompt_len: int, script: list[int]):
    # a logits processor that makes the scripted token the argmax at each position
    def force(tokens, logits):
        i = tokens.shape[-1] - prompt_len
        if i < len(script):
            logits = logits + 1e4 * (mx.arange(logits.shape[-1]) == script[i])
        return logits

    return force


def _text_of(tok, ids):
    d = tok.detokenizer
    for t in ids:
        d.add_token(t)
    d.finalize()
    return d.text


@pytest.mark.parametrize("forced", FORCED)
def test_every_substring_as_stop_cuts_tokens_and_text_together(tiny, forced):
    model, tok = tiny
    prompt = tok.encode("The quick brown fox")
    script = tok.encode(forced, add_special_tokens=False)
    full = _text_of(tok, script)
    stops = sorted({full[i:j] for i in range(len(full)) for j in range(i + 1, len(full) + 1)})
    counts = {"plain": 0, "drafts": 0}
    for stop in stops:
        cut = full.find(stop)
        # the reference: the fewest scripted tokens whose decoded text holds the stop string
        k = next(k for k in range(1, len(script) + 1) if stop in _text_of(tok, script[:k]))
        for name in counts:
            drafter = OracleDrafter(len(prompt), script, chain(3), model.args.vocab_size)
            rs = list(
                stream_generate(
                    model,
                    tok,
                    prompt,
                    max_tokens=len(script),
                    stop=stop,
                    logits_processors=[_forcer(len(prompt), script)],
                    drafter=drafter if name == "drafts" else None,
                )
            )
            text = "".join(r.text for r in rs)
            tokens = [t for r in rs for t in r.tokens]
            lps = [x for r in rs for x in r.logprobs]
            assert text == full[:cut], (stop, text)
            assert tokens == script[:k], (stop, tokens, script[:k])
            assert len(lps) == k and rs[-1].finish_reason == "stop"
            assert rs[-1].generation_tokens == k
            assert all(full[:cut].startswith("".join(r.text for r in rs[: i + 1])) for i in range(len(rs)))
            counts[name] += 1
    assert counts["plain"] == counts["drafts"] == len(stops) > 20


def test_the_reported_case_on_the_default_model(real):
    # "Hello a b=  x =  1" forced, stop "a b=  ": the text ends before "a b=", and the
    # tokens end with the one that completes "a b=  " (the streaming detokenizer shows
    # that token's trailing space only once the next token arrives)
    model, tok = real
    prompt = tok.encode("Say something.")
    script = tok.encode("Hello a b=  x =  1", add_special_tokens=False)
    k = next(k for k in range(1, len(script) + 1) if "a b=  " in _text_of(tok, script[:k]))
    for drafter in (None, OracleDrafter(len(prompt), script, chain(3), model.args.vocab_size)):
        rs = list(
            stream_generate(
                model,
                tok,
                prompt,
                max_tokens=len(script),
                stop="a b=  ",
                logits_processors=[_forcer(len(prompt), script)],
                drafter=drafter,
            )
        )
        assert "".join(r.text for r in rs) == "Hello "
        assert [t for r in rs for t in r.tokens] == script[:k] and k < len(script)
        assert len([x for r in rs for x in r.logprobs]) == k
