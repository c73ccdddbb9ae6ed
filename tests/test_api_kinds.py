"""Every public name of mlx_stream, given an argument of the wrong kind, raises TypeError or
ValueError naming what to pass (issue 38), not an AttributeError from deep inside."""

import numpy as np
import pytest

import mlx_stream as ms
from mlx_stream.cost import StepCosts
from mlx_stream.heads import new_heads
from mlx_stream.tree import chain


class Odd:
    """A value of no kind any parameter accepts."""


WRONG = [Odd(), "x", 3, 2.5, [1], None, b"x", {"a": 1}, True, -1]

# what Python says when a wrong kind reaches code that never checked it
UNCHECKED = (
    "has no attribute",
    "unsupported operand",
    "not subscriptable",
    "not iterable",
    "not callable",
    "cannot be interpreted",
    "argument of type",
    "not supported between",
    "unhashable",
    "expected str, bytes or os.PathLike",
    "must be real number",
    "object is not",
)

# names that take no arguments to get wrong: constants, records and the drafting protocol
NOT_CALLED = {"DEFAULT_HEADS", "DEFAULT_MODEL", "Drafter", "GenerationResponse", "Tree", "NoDrafter"}


def _calls(model, tok, tiny_dir, tmp_path):
    """For each public callable: the call and one set of arguments it accepts."""
    ids = [5, 6, 7]
    headed = ms.SpeculativeModel(model.backbone, new_heads(model.backbone, tok, 2, scale=0.5, seed=0))
    store = ms.Datastore(np.arange(20, dtype=np.int32))
    return {
        "stream_generate": (
            lambda **k: list(ms.stream_generate(**k)),
            dict(
                model=model,
                tokenizer=tok,
                prompt=ids,
                max_tokens=2,
                temp=0.5,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                min_tokens_to_keep=1,
                seed=1,
                stop=["zzz"],
                prefill_step_size=64,
                top_logprobs=0,
                adaptive=False,
                prompt_lookup=2,
                max_kv_size=200,
                kv_group_size=64,
                quantized_kv_start=5000,
                logits_processors=[],
                drafter=ms.NoDrafter(),
                tree="none",
            ),
        ),
        "generate": (ms.generate, dict(model=model, tokenizer=tok, prompt=ids, max_tokens=2)),
        "ChatSession": (ms.ChatSession, dict(model=model, tokenizer=tok, system="s", max_tokens=2, temp=0.0)),
        "ChatSession.send": (
            lambda **k: list(ms.ChatSession(model, tok, max_tokens=2).send(**k)),
            dict(text="hi"),
        ),
        "PromptCache": (ms.PromptCache, dict(model=model, max_kv_size=64)),
        "cache_prompt": (
            ms.cache_prompt,
            dict(model=model, tokenizer=tok, prompt="hi", prefill_step_size=64),
        ),
        "save_prompt_cache": (
            ms.save_prompt_cache,
            dict(
                path=tmp_path / "c.safetensors",
                cache=ms.cache_prompt(model, tok, "hi"),
                model_spec="m",
                tokenizer=tok,
            ),
        ),
        "load_prompt_cache": (
            ms.load_prompt_cache,
            dict(path=tmp_path / "c.safetensors", model=model, tokenizer=tok),
        ),
        "chain": (ms.chain, dict(k=3)),
        "build_tree": (ms.build_tree, dict(choices=[[0], [0, 0]])),
        "parse_tree": (ms.parse_tree, dict(spec="chain:2", num_heads=3)),
        "resolve_tree": (ms.resolve_tree, dict(model=model, spec="0;0,0")),
        "make_drafter": (ms.make_drafter, dict(model=model, prompt_lookup=2, store=store, sampled=False)),
        "plan_drafting": (ms.plan_drafting, dict(model=model, prompt_lookup=2)),
        "build_drafter": (ms.build_drafter, dict(model=model, plan=ms.plan_drafting(model, prompt_lookup=2))),
        "load": (ms.load, dict(model=str(tiny_dir), heads=None, dtype="float32", learn=False)),
        "load_draft": (
            ms.load_draft,
            dict(spec=str(tiny_dir), target=model, tokenizer=tok, calibrate=False, p_min=0.5),
        ),
        "SpeculativeModel": (ms.SpeculativeModel, dict(backbone=model.backbone)),
        "HeadsDrafter": (ms.HeadsDrafter, dict(model=headed, tree=chain(2))),
        "LookupDrafter": (
            ms.LookupDrafter,
            dict(
                base=ms.NoDrafter(),
                num_draft=3,
                max_ngram=4,
                min_ngram=2,
                min_accept=0.1,
                explore_every=4,
                decay=0.1,
                prior=0.2,
                store=store,
            ),
        ),
        "BudgetDrafter": (
            ms.BudgetDrafter,
            dict(model=headed, costs=StepCosts({1: 1.0, 2: 1.1}, 10.0), num_draft=3, max_heads=4),
        ),
        "OracleDrafter": (
            ms.OracleDrafter,
            dict(prompt_len=3, continuation=[1, 2], tree=chain(2), vocab_size=100),
        ),
        "Datastore": (ms.Datastore, dict(tokens=np.arange(20, dtype=np.int32), max_ngram=4)),
        "DraftStore": (ms.DraftStore, dict(shipped=store, learn=True, max_ngram=4, more=[store])),
        "AnswerStore": (ms.AnswerStore, dict(path=tmp_path / "answers", tokenizer_hash="abc", max_tokens=64)),
    }


def test_every_public_name_refuses_wrong_kinds_with_a_clear_error(tiny, tiny_dir, tmp_path):
    model, tok = tiny
    calls = _calls(model, tok, tiny_dir, tmp_path)
    swept = {name.split(".")[0] for name in calls}
    assert swept | NOT_CALLED == set(ms.__all__), "a public name the sweep does not cover"
    unclear = []
    for name, (call, good) in calls.items():
        call(**good)  # the arguments the sweep varies are accepted as they are
        for param, value in good.items():
            for wrong in WRONG:
                if (
                    type(wrong) is type(value)
                    or (value is None)
                    or (param == "spec" and isinstance(wrong, str))
                ):
                    continue  # the same kind: not a wrong kind (a spec string is checked by value)
                if name == "stream_generate" and param == "prompt" and isinstance(wrong, (str, list)):
                    continue  # a text prompt, token ids
                try:
                    call(**{**good, param: wrong})
                except (
                    TypeError,
                    ValueError,
                    FileNotFoundError,
                ) as e:  # a path of the right kind: no such file
                    if any(s in str(e) for s in UNCHECKED):
                        unclear.append(f"{name}({param}={wrong!r}): {type(e).__name__}: {e}")
                    continue
                except Exception as e:  # noqa: BLE001 - any other exception is what this test finds
                    unclear.append(f"{name}({param}={wrong!r}): {type(e).__name__}: {e}")
                    continue
                if isinstance(wrong, Odd):
                    unclear.append(f"{name}({param}=Odd()): accepted")
    assert not unclear, "\n".join(unclear)


def test_the_errors_name_what_to_pass(tiny):
    model, tok = tiny
    with pytest.raises(TypeError, match=r"SpeculativeModel that mlx_stream.load returns"):
        ms.generate(model.backbone, tok, "hi")
    with pytest.raises(TypeError, match=r"tokenizer that mlx_stream.load \(or mlx_lm.load\) returns"):
        ms.generate(model, "gpt2", "hi")
    with pytest.raises(TypeError, match=r"a list of rank paths"):
        ms.parse_tree(3, 2)
    with pytest.raises(TypeError, match=r"stop must be a str, a list of str or None"):
        ms.generate(model, tok, "hi", stop=3)
    with pytest.raises(TypeError, match=r"unknown generation argument 'temperature'"):
        ms.ChatSession(model, tok, temperature=0.5)
    with pytest.raises(TypeError, match=r"heads must be 'default', 'none', a heads folder"):
        ms.load("x", heads=3)
