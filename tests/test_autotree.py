"""tree="auto": the heads' candidate with the best tau / cost on this device (costs cached per device)."""

import json

import pytest
from helpers import mlx_lm_greedy, ours

from mlx_stream.cost import device_key
from mlx_stream.heads import new_heads
from mlx_stream.speculation import auto_tree


@pytest.fixture()
def with_heads(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=2, architecture="hydra")
    return model, tok


def test_picks_the_best_expected_speed_and_caches_it(with_heads, tmp_path):
    model, _ = with_heads
    # trees whose (made-up) taus dwarf any cost beat plain decoding on any device, also on a
    # loaded machine where drafting the tiny model's tree costs several of its 1-token forwards
    model.heads.config.tree_taus = {"0": 1.05, "0;0,0": 30.0, "0;1;0,0;0,0,0": 31.0}
    tree, info = auto_tree(model)
    rows = info["sizes"]
    assert [r["tree"] for r in rows][0] == "none" and rows[0]["tau"] == 1.0  # plain is always a candidate
    best = max(rows, key=lambda r: r["speedup_bound"])
    assert rows[info["best"]] is best or rows[info["best"]] == best
    assert best["speedup_bound"] == pytest.approx(best["tau"] / best["cost"])
    assert best["tree"] in ("0;0,0", "0;1;0,0;0,0,0") and not info["cached"]
    files = list((tmp_path / "cache" / "costs").glob("*.json"))  # the measured costs, cached
    key = json.loads(files[0].read_text())["key"]
    assert len(files) == 1 and key == device_key(model) | {"trees": [2, 3, 5]}
    again, info2 = auto_tree(model)
    assert info2["cached"] and again.choices == tree.choices
    # an unreadable cache entry is measured again and rewritten
    files[0].write_text("{broken")
    _, info3 = auto_tree(model)
    assert not info3["cached"] and json.loads(files[0].read_text())["key"] == key


def test_plain_decoding_wins_when_no_tree_pays(with_heads):
    model, _ = with_heads
    model.heads.config.tree_taus = {"0;1;2;0,0;0,1;1,0;0,0,0": 1.001}  # 7 drafts, almost never accepted
    tree, info = auto_tree(model, refresh=True)
    assert tree.size == 1 and info["sizes"][info["best"]]["tree"] == "none"


def test_other_heads_get_their_own_choice(with_heads, tmp_path):
    model, tok = with_heads
    model.heads.config.tree_taus = {"0": 1.5}
    auto_tree(model)
    model.heads.config.tree_taus = {"0": 1.5, "0;0,0": 2.5}
    _, info = auto_tree(model)
    assert not info["cached"] and len(list((tmp_path / "cache" / "costs").glob("*.json"))) == 2


def test_generation_with_tree_auto_is_lossless(with_heads):
    model, tok = with_heads
    model.heads.config.tree_taus = {"0": 1.5, "0;0,0": 2.5, "0;1;0,0": 2.6}
    for p in ["The quick brown fox", "heads, trees!"]:
        ids = tok.encode(p)
        got, _ = ours(model, tok, ids, 32, tree="auto")
        assert got == mlx_lm_greedy(model, tok, ids, 32)


def test_auto_needs_heads_with_candidates(tiny, with_heads):
    model, tok = with_heads
    model.heads.config.tree_taus = {}
    with pytest.raises(ValueError, match="no candidate trees"):
        auto_tree(model)
    model.heads = None
    with pytest.raises(ValueError, match="load heads"):
        auto_tree(model)
