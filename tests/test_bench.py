"""The side-by-side stopwatch times mlx-lm's stream and ours alike."""

from types import SimpleNamespace

from mlx_stream.bench import timed_tokens

EOS = 2


def _clock(times):
    it = iter(times)
    return lambda: next(it)


def test_one_stopwatch_leaves_out_eos_and_the_first_response():
    # mlx-lm: one token per response, the last one EOS (its step is timed, its token not)
    plain = [SimpleNamespace(token=t) for t in (5, 6, 7, EOS)]
    toks, rate, last = timed_tokens(
        plain, lambda r: [] if r.token == EOS else [r.token], _clock([1.0, 1.5, 2.0, 2.5])
    )
    assert toks == [5, 6, 7] and last.token == EOS
    assert rate == 2 / 1.5  # 6 and 7, from the first response (1.0) to the EOS step (2.5)
    # ours: several tokens a step, a final response with none (EOS found alone)
    spec = [SimpleNamespace(tokens=t) for t in ([5], [6, 7], [])]
    toks, rate, _ = timed_tokens(spec, lambda r: r.tokens, _clock([1.0, 1.5, 2.5]))
    assert toks == [5, 6, 7] and rate == 2 / 1.5


def test_a_stream_with_nothing_after_its_first_token_has_no_rate():
    one = [SimpleNamespace(tokens=[5]), SimpleNamespace(tokens=[])]
    assert timed_tokens(one, lambda r: r.tokens, _clock([1.0, 2.0]))[1] == 0.0
    assert timed_tokens([], lambda r: r.tokens)[:2] == ([], 0.0)
