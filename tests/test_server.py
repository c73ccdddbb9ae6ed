"""`mlx-stream server`: a real server process on 127.0.0.1, talked to with the official
`openai` client and with raw HTTP (httpx) for malformed requests."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from mlx_stream.server import APIError, parse_request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *args: str):
        self.model = model
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mlx_stream.cli", "server", "--model", model, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, *args, "--log-level", "warning"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            self.close()
            raise RuntimeError("the server did not come up in 120 s")
        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def heads_dir(tiny_dir, tmp_path_factory) -> Path:
    """Random (untrained) heads for the tiny model: drafts are mostly rejected, but every
    step still drafts and verifies a tree."""
    import mlx.core as mx

    from mlx_stream import load
    from mlx_stream.heads import new_heads, save_heads

    mx.random.seed(3)
    model, tok = load(str(tiny_dir), dtype="float32")
    path = tmp_path_factory.mktemp("heads") / "heads"
    save_heads(new_heads(model.backbone, tok, 3), path)
    return path


@pytest.fixture(scope="module")
def server(tiny_dir, heads_dir):
    s = Server(str(tiny_dir), "--heads", str(heads_dir), "--tree", "0;1;0,0", "--prompt-lookup", "4")
    yield s
    s.close()


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A tiny model with a long context: generations long enough (4,000 tokens, seconds)
    to disconnect in the middle of."""
    from conftest import make_tiny_model_dir

    s = Server(
        str(make_tiny_model_dir(tmp_path_factory.mktemp("long") / "model", context=8192)),
        "--heads",
        "none",
        "--max-tokens",
        "4000",  # for requests that give none: the chat page's
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(tiny_dir, heads_dir):
    from mlx_stream import load

    return load(str(tiny_dir), heads=str(heads_dir), dtype="float32")


def _chat_text(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


def test_chat_and_completions_equal_the_library(server, local):
    from mlx_stream import generate

    model, tok = local
    want = generate(model, tok, _chat_text(tok, MESSAGES), max_tokens=40, tree="0;1;0,0", prompt_lookup=4)
    r = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=40)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens == len(tok.encode(_chat_text(tok, MESSAGES), add_special_tokens=False))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0
    spec = r.model_extra["speculation"]
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"] and spec["tau"] >= 1.0
    # raw completions: text and token-id prompts
    want = generate(model, tok, "Speculative decoding", max_tokens=30, tree="0;1;0,0", prompt_lookup=4)
    r = server.client.completions.create(model=server.model, prompt="Speculative decoding", max_tokens=30)
    assert r.choices[0].text == want and r.object == "text_completion"
    ids = tok.encode("Speculative decoding")
    r = server.client.completions.create(model=server.model, prompt=ids, max_tokens=30)
    assert r.choices[0].text == want


def test_streaming_chat_and_usage(server):
    full = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=40)
    chunks = list(
        server.client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == full.choices[0].finish_reason and all(x is None for x in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: reused
    # raw SSE: data lines, the last one [DONE]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "The lazy dog", "max_tokens": 8, "stream": True},
        timeout=60,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in resp.iter_lines() if x]
    assert all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"
    assert "speculation" in json.loads(lines[-2][6:])


def test_logprobs_and_stop(server, local):
    r = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)  # greedy: the top token
    text = r.choices[0].message.content
    stop = text[5:9]
    r = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=12, stop=[stop]
    )
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r = server.client.completions.create(model=server.model, prompt="The lazy dog", max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # (mlx-lm's streaming detokenizer drops the first token's leading space from the text)
    assert "".join(lp.tokens).lstrip() == r.choices[0].text.lstrip()


def test_seeded_sampling_is_reproducible(server):
    kw = {"model": server.model, "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, "top_p": 0.9}
    a = server.client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = server.client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b


BAD = [
    ("/v1/chat/completions", b'{"messages": [', 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"{}", 400, "messages"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages"),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 1.5}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "seed": -1}', 400, "seed"),
    ("/v1/completions", b'{"prompt": "x", "stop": 5}', 400, "stop"),
    ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
    ("/v1/completions", b'{"prompt": [100000]}', 400, "prompt"),
    ("/v1/completions", ('{"prompt": "' + "fox " * 600 + '"}').encode(), 400, "prompt"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    ("/v1/completions", b'{"model": 123, "prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, 400, None),
    ("/v1/completions", b'{"prompt": "\\ud800 x"}', 400, "prompt"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages[0].content",
    ),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e-40}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "top_p": 1e-46}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999": 5}}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"3": 500}}', 400, "logit_bias"),
    ("/v1/completions", b'{"prompt": "x", "echo": true}', 400, "echo"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}',
        400,
        "response_format",
    ),
    (
        "/v1/completions",
        b'{"prompt": "x", "max_completion_tokens": 2, "max_tokens": "bad"}',
        400,
        "max_tokens",
    ),
    ("/v1/nothing", b"{}", 404, None),
]


def test_bad_requests_answer_like_openai_and_the_server_keeps_serving(server):
    for path, body, status, param in BAD:
        r = httpx.post(
            server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30
        )
        assert r.status_code == status, (path, body[:60], r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] and err["param"] == param, (body[:60], err)
    assert httpx.get(server.url + "/v1/nothing", timeout=5).status_code == 404
    r = server.client.completions.create(model=server.model, prompt="x", max_tokens=3)
    assert r.choices[0].text is not None  # still serving
    models = server.client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_concurrent_clients_get_their_solo_outputs(server):
    prompts = ["The quick brown fox", "Speculative decoding drafts", "naïve café", "0123456789"]

    def ask(p):
        msgs = [{"role": "user", "content": p}]
        return server.client.chat.completions.create(model=server.model, messages=msgs, max_tokens=32)

    solo = [ask(p).choices[0].message.content for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = [r.choices[0].message.content for r in pool.map(ask, prompts)]
    assert together == solo


def test_interleaved_conversations_reuse_their_own_history(server):
    chats = [[{"role": "user", "content": p}] for p in ("The quick brown fox", "0123456789 naïve")]
    first = []
    for msgs in chats:  # turn 1 of each, one after the other
        r = server.client.chat.completions.create(model=server.model, messages=msgs, max_tokens=16)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        msgs.append({"role": "user", "content": "and then?"})
        first.append(r.usage.prompt_tokens)
    for msgs, n in zip(chats, first):  # turn 2 of each: its whole first turn comes from its slot
        r = server.client.chat.completions.create(model=server.model, messages=msgs, max_tokens=16)
        assert r.usage.prompt_tokens_details.cached_tokens >= n


def _wait_cancelled(server, before: dict) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = server.health()
        if h["requests"]["cancelled"] > before["cancelled"] and not h["busy"]:
            return h
        time.sleep(0.05)
    return h


def test_a_client_that_disconnects_stops_its_generation(long_server):
    server = long_server
    body = {"prompt": "The quick brown fox", "max_tokens": 4000, "stream": True}
    before = server.health()["requests"]
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 4:
                break  # leaving the block closes the connection
    h = _wait_cancelled(server, before)
    assert h["requests"]["cancelled"] == before["cancelled"] + 1
    assert h["requests"]["completion_tokens"] - before["completion_tokens"] < 4000


def test_a_non_streaming_client_that_disconnects_stops_its_generation(long_server):
    server = long_server
    before = server.health()["requests"]
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4000}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)  # generating by now
    h = _wait_cancelled(server, before)
    assert h["requests"]["cancelled"] == before["cancelled"] + 1
    assert h["requests"]["completion_tokens"] - before["completion_tokens"] < 4000


def test_logit_bias_and_penalties_change_the_output(server, local):
    from mlx_stream import stream_generate

    model, tok = local
    prompt = "The quick brown fox"
    first = next(stream_generate(model, tok, prompt, max_tokens=1)).tokens[0]
    base = server.client.completions.create(model=server.model, prompt=prompt, max_tokens=8)
    biased = server.client.completions.create(
        model=server.model, prompt=prompt, max_tokens=8, logit_bias={str(first): -100}, logprobs=1
    )
    assert biased.choices[0].text != base.choices[0].text
    assert tok.decode([first]) not in biased.choices[0].logprobs.top_logprobs[0]  # never the top one now
    penalised = server.client.completions.create(
        model=server.model, prompt=prompt, max_tokens=8, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert penalised.choices[0].finish_reason in ("stop", "length")


def test_parse_request_defaults_and_aliases():
    d = {"max_tokens": 512, "temp": 0.0}
    r = parse_request(
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}]}, "chat", "m", d
    )
    assert r.messages == [{"role": "system", "content": "hi"}]
    assert r.settings["max_tokens"] == 512 and r.settings["temp"] == 0.0 and not r.stream
    r = parse_request({"prompt": ["x"], "max_completion_tokens": 7, "model": "m"}, "completion", "m", d)
    assert r.prompt == "x" and r.settings["max_tokens"] == 7
    with pytest.raises(APIError, match="top_logprobs"):
        parse_request({"messages": MESSAGES, "top_logprobs": 2}, "chat", "m", d)
    with pytest.raises(APIError, match="stream_options"):
        parse_request({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "chat", "m", d)


@pytest.mark.slow  # the tiny-model tests above stream the same way
def test_real_model_streamed_greedy_text_equals_generate(real):
    from mlx_stream import generate

    model, tok = real
    s = Server("smollm2-135m-instruct", "--dtype", "float32")
    try:
        for turn in ("Give me two tips for writing tests.", "Now one more."):
            msgs = [{"role": "user", "content": turn}]
            want = generate(model, tok, _chat_text(tok, msgs), max_tokens=48)
            stream = s.client.chat.completions.create(
                model=s.model, messages=msgs, max_tokens=48, stream=True
            )
            got = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert got == want
    finally:
        s.close()


KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server on the network's terms: an API key, one request queued at most, a 16 KiB
    body cap, a 1 s decoding timeout; a long context so requests last."""
    from conftest import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path_factory.mktemp("guarded") / "model", context=8192)
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# the team's keys\nsk-other\n")
    s = Server(
        str(model),
        "--heads",
        "none",
        "--api-key",
        KEY,
        "--api-key",
        f"@{keys}",
        "--max-queue",
        "1",
        "--max-body-mb",
        str(16 / 1024),
        "--request-timeout",
        "1",
    )
    yield s
    s.close()


def _post(server, path, body, key=KEY, **kw):
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    return httpx.post(
        server.url + path, content=body, headers=headers | kw.pop("headers", {}), timeout=60, **kw
    )


def test_api_keys_body_limit_metrics_and_timeout(guarded):
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4}).encode()
    for key in (None, "wrong", KEY[:-1]):
        r = _post(guarded, "/v1/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(guarded.url + "/v1/models", timeout=5).status_code == 401
    assert guarded.health()["status"] == "ok"  # /health needs no key
    assert _post(guarded, "/v1/completions", body).status_code == 200
    assert _post(guarded, "/v1/completions", body, key="sk-other").status_code == 200  # from the key file
    ok = OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert ok.completions.create(model=guarded.model, prompt="x", max_tokens=3).choices[0].text is not None
    # bodies past 16 KiB: refused from the header, and from the bytes when no length is given
    big = json.dumps({"prompt": "x" * 20_000, "max_tokens": 4}).encode()
    r = _post(guarded, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = _post(guarded, "/v1/completions", iter([big[:8000], big[8000:]]))  # chunked: no Content-Length
    assert r.status_code == 413
    # the timeout ends a long generation as a length stop, streamed or not
    long = {"prompt": "The quick brown fox", "max_tokens": 4000}
    tic = time.monotonic()
    r = ok.completions.create(model=guarded.model, **long)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens < 4000
    assert time.monotonic() - tic < 30
    chunks = list(ok.completions.create(model=guarded.model, stream=True, **long))
    assert chunks[-1].choices[0].finish_reason == "length"
    metrics = httpx.get(guarded.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=5).text
    assert 'mlx_stream_requests_total{route="/v1/completions",status="401"} 3.0' in metrics
    assert 'status="413"} 2.0' in metrics and "mlx_stream_time_to_first_token_seconds_count" in metrics
    assert "mlx_stream_queue_depth 0.0" in metrics and "mlx_stream_tau_count" in metrics


def test_a_full_queue_answers_503_at_once(guarded):
    long = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4000, "stream": True}).encode()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # one decoding (1 s: the timeout), one queued behind it: the queue (1) is full
        running = pool.submit(_post, guarded, "/v1/completions", long)
        deadline = time.monotonic() + 20
        while guarded.health()["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        queued = pool.submit(_post, guarded, "/v1/completions", long)
        while guarded.health()["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        tic = time.monotonic()
        r = _post(guarded, "/v1/completions", long)
        assert r.status_code == 503, r.text
        assert time.monotonic() - tic < 1.0  # at once, not after the queue
        assert r.json()["error"]["code"] == "server_overloaded" and int(r.headers["retry-after"]) >= 1
        assert running.result().status_code == 200 and queued.result().status_code == 200


def test_logprob_bytes_rebuild_multibyte_text():
    """Each token's own bytes (not the UTF-8 of its decoded text): joined they give back
    emoji and CJK text exactly, for the byte-level BPE of the default model and the tiny one."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    from mlx_stream.loader import load
    from mlx_stream.server import _Completions, token_bytes

    _, tok = load("smollm2-135m-instruct", heads="none")
    assert isinstance(tok._detokenizer, BPEStreamingDetokenizer)
    table = token_bytes(tok)
    assert len(table) == len(tok._detokenizer.tokenmap)
    for text in ("🎉🎂🚀 party", "日本語のテキスト", "naïve café — ok", "<|im_start|>user"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(table[t] for t in ids) == text.encode(), text
        assert any(tok.decode([t]) == "\ufffd" for t in tok.encode("🎉", add_special_tokens=False))
    fmt = _Completions(
        parse_request({"prompt": "x", "logprobs": 1}, "completion", "m", {"max_tokens": 8, "temp": 0.0}),
        tok,
        table,
    )
    pieces = [fmt._legacy_token(t) for t in tok.encode("🎉!", add_special_tokens=False)]
    assert pieces[0].startswith("bytes:\\x") and pieces[-1] == "!"


def _browser(profile: Path):
    """Headless Debian chromium through selenium, with a fresh profile in ``profile``;
    skips the test where chromium, chromedriver or selenium is absent."""
    import shutil

    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not (chrome and driver):
        pytest.skip("no chromium + chromedriver here (make setup installs Debian's on Linux with apt)")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    flags = (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        # nothing but the page under test: no update checks, sync or first-run pages
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1000,700",
    )
    for flag in flags:
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_the_chat_page_streams_an_answer_and_marks_the_drafts(tiny_dir, tmp_path):
    """The page at / in a real headless browser: it asks for the key, streams an answer
    through the API, shows tokens/s and tau, and shades the text of accepted drafts (the
    tiny model drafting for itself: every draft is accepted). The screenshot is kept in
    runs/screenshots/chat_page.png."""
    import os

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser(tmp_path / "profile")
    os.environ["MLX_STREAM_CACHE"], before = str(tmp_path / "cache"), os.environ.get("MLX_STREAM_CACHE")
    try:
        s = Server(str(tiny_dir), "--draft-model", str(tiny_dir), "--num-draft-tokens", "3", "--api-key", KEY)
    finally:
        os.environ.pop("MLX_STREAM_CACHE") if before is None else os.environ.update(MLX_STREAM_CACHE=before)
    try:
        browser.get(s.url + "/")
        assert "mlx-stream" in browser.title
        key = browser.find_element(By.ID, "key")
        key.send_keys(KEY)
        browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == s.model)
        browser.find_element(By.ID, "input").send_keys("The quick brown fox")
        browser.find_element(By.ID, "send").click()
        done = WebDriverWait(browser, 120).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, ".turn.assistant[data-done='1']")
        )
        answer = done[0]
        assert answer.text.strip()  # the streamed answer
        assert not answer.find_elements(By.CLASS_NAME, "error"), answer.text
        assert answer.find_elements(By.CSS_SELECTOR, "span.drafted")  # accepted drafts are shaded
        stats = browser.find_element(By.ID, "stats").text
        assert "tau" in stats and "tau -" not in stats and "tokens/s -" not in stats, stats
        shots = Path(__file__).resolve().parent.parent / "runs" / "screenshots"
        shots.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(shots / "chat_page.png"))
        # without the key the page says what is wrong instead of answering
        browser.execute_script("localStorage.clear()")
        browser.get(s.url + "/")
        WebDriverWait(browser, 20).until(lambda b: "API key" in b.find_element(By.ID, "model").text)
    finally:
        browser.quit()
        s.close()


# the bodies the page posts to the API, recorded in the page (window.sent) as it sends them
RECORD_REQUESTS = """
window.sent = [];
const fetched = window.fetch;
window.fetch = (url, opts) => {
  if (String(url).includes("/chat/completions")) window.sent.push(JSON.parse(opts.body));
  return fetched(url, opts);
};
"""


def test_the_chat_page_answers_one_turn_at_a_time_and_stops(long_server, tmp_path):
    """The page at / in headless chromium, a reply of up to 4,000 tokens (seconds): Enter
    while it streams sends nothing, Stop ends it (the button says Send again, the server
    frees the worker), the partial reply stays as the assistant turn, and the next turn's
    request carries user / assistant / user. Screenshots: runs/screenshots/chat_page_*.png."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    s = long_server
    browser = _browser(tmp_path / "profile")
    shots = Path(__file__).resolve().parent.parent / "runs" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    try:
        browser.get(s.url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == s.model)
        browser.execute_script(RECORD_REQUESTS)
        box, button = browser.find_element(By.ID, "input"), browser.find_element(By.ID, "send")
        before = s.health()["requests"]
        box.send_keys("The quick brown fox", Keys.ENTER, Keys.ENTER)  # Enter twice at once
        WebDriverWait(browser, 30).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, ".turn.assistant span")
        )  # streaming
        box.send_keys("Tell me more", Keys.ENTER)  # Enter while the reply streams: nothing goes out
        time.sleep(0.2)  # (a request would have gone out at once: the page sends as Enter is handled)
        assert browser.execute_script("return window.sent.length") == 1
        assert button.text == "Stop"
        assert len(browser.find_elements(By.CSS_SELECTOR, ".turn.user")) == 1
        assert box.get_attribute("value") == "Tell me more"  # kept for when the reply is done
        button.click()  # Stop
        reply = WebDriverWait(browser, 10).until(
            lambda b: b.find_element(By.CSS_SELECTOR, ".turn.assistant[data-done='1']")
        )
        assert button.text == "Send"
        assert browser.save_screenshot(str(shots / "chat_page_stopped.png"))
        partial = browser.execute_script("return conversation[1].content")
        time.sleep(0.5)
        assert browser.execute_script("return conversation[1].content") == partial  # stopped growing
        assert partial and len(reply.find_elements(By.TAG_NAME, "span")) < 4000
        roles = browser.execute_script("return conversation.map((m) => m.role)")
        assert roles == ["user", "assistant"]
        h = _wait_cancelled(s, before)  # the server let the request go
        assert h["requests"]["cancelled"] == before["cancelled"] + 1 and not h["busy"]
        # the next turn carries the stopped reply as the assistant turn
        box.send_keys(Keys.ENTER)
        WebDriverWait(browser, 10).until(lambda b: b.execute_script("return window.sent.length") == 2)
        sent = browser.execute_script("return window.sent[1].messages")
        assert [m["role"] for m in sent] == ["user", "assistant", "user"]
        assert [m["content"] for m in sent] == ["The quick brown fox", partial, "Tell me more"]
        second = "return document.querySelectorAll('.turn.assistant')[1].querySelectorAll('span').length"
        WebDriverWait(browser, 30).until(lambda b: b.execute_script(second) > 0)  # streaming
        button.click()
        WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "send").text == "Send")
        roles = browser.execute_script("return conversation.map((m) => m.role)")
        assert roles == ["user", "assistant", "user", "assistant"]
        assert browser.save_screenshot(str(shots / "chat_page_history.png"))
        # a refused turn (a prompt too long for the context window) leaves no dangling user turn
        browser.execute_script("document.getElementById('input').value = 'fox '.repeat(140000)")
        box.send_keys(Keys.ENTER)
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".turn .error"))
        WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "send").text == "Send")
        assert browser.execute_script("return conversation.map((m) => m.role)") == roles
    finally:
        browser.quit()


def test_response_format_text_and_model_retrieve(server):
    """``response_format: {"type": "text"}`` (OpenAI's default) is a no-op; JSON modes are
    still refused. ``GET /v1/models/{id}``: the client's ``models.retrieve``."""
    import openai

    kw = {"model": server.model, "messages": MESSAGES, "max_tokens": 12}
    plain = server.client.chat.completions.create(**kw).choices[0].message.content
    text = server.client.chat.completions.create(response_format={"type": "text"}, **kw)
    assert text.choices[0].message.content == plain
    r = server.client.completions.create(
        model=server.model, prompt="x", max_tokens=3, extra_body={"response_format": {"type": "text"}}
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}, "text"):
        r = httpx.post(server.url + "/v1/chat/completions", json={**kw, "response_format": fmt}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and "JSON" in err["message"], err
    m = server.client.models.retrieve(server.model)  # the id is a path here: '/' quoted as %2F
    assert m.id == server.model and m.object == "model" and m.owned_by == "mlx-stream"
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")
    r = httpx.get(server.url + "/v1/models/gpt-4", timeout=5)
    assert r.status_code == 404
    err = r.json()["error"]
    assert (
        err["code"] == "model_not_found"
        and err["type"] == "invalid_request_error"
        and "gpt-4" in err["message"]
    )


def _metrics(server) -> dict:
    """/metrics as {(name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_health_and_metrics_count_the_same(long_server):
    """One count behind /health and /metrics: after a request, a streamed one, a streamed one
    dropped mid-way and two errors, both report the same requests and tokens, which add up to
    the usage the answers reported plus what the dropped request generated."""
    s = long_server
    h0, m0 = s.health(), _metrics(s)
    prompt = "The quick brown fox"
    whole = s.client.completions.create(model=s.model, prompt=prompt, max_tokens=20)
    chunks = list(
        s.client.completions.create(
            model=s.model, prompt=prompt, max_tokens=30, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = chunks[-1].usage
    seen = 0  # tokens the dropped request's client received
    body = {"prompt": prompt, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen += json.loads(line[6:])["mlx_stream"]["tokens"]
            if seen >= 8:
                break
    h = _wait_cancelled(s, h0["requests"])
    # refused by the engine (a token id outside the vocabulary), and before it (bad JSON)
    r = httpx.post(s.url + "/v1/completions", json={"prompt": [100000], "max_tokens": 3}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(s.url + "/v1/completions", content=b"{", timeout=30)
    assert r.status_code == 400

    def route(m, status):
        key = ("mlx_stream_requests_total", (("route", "/v1/completions"), ("status", status)))
        return m.get(key, 0.0) - m0.get(key, 0.0)

    deadline = time.monotonic() + 10
    while route(m := _metrics(s), "200") < 3 and time.monotonic() < deadline:  # the dropped one's answer
        time.sleep(0.05)
    h = s.health()
    dh = {k: h["requests"][k] - h0["requests"].get(k, 0) for k in h["requests"]}

    def dm(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return m.get(key, 0.0) - m0.get(key, 0.0)

    assert dh["served"] == 2 and dh["cancelled"] == 1 and dh["failed"] == 1 and dh["timed_out"] == 0, dh
    for outcome in ("served", "cancelled", "failed", "timed_out"):
        assert dm("mlx_stream_engine_requests_total", outcome=outcome) == dh[outcome], outcome
    assert route(m, "200") == 3 and route(m, "400") == 2
    dropped = dh["completion_tokens"] - whole.usage.completion_tokens - streamed.completion_tokens
    assert seen <= dropped < 4000
    assert dm("mlx_stream_completion_tokens_total") == dh["completion_tokens"]
    assert (
        dh["prompt_tokens"] == whole.usage.prompt_tokens + streamed.prompt_tokens + whole.usage.prompt_tokens
    )
    assert dm("mlx_stream_prompt_tokens_total") == dh["prompt_tokens"]
    # the three requests that generated tokens, in every per-request histogram
    for hist in ("mlx_stream_time_to_first_token_seconds", "mlx_stream_request_seconds", "mlx_stream_tau"):
        assert dm(hist + "_count") == 3, hist
    assert h["running"] == h["queued"] == 0 and not h["busy"]
    assert m[("mlx_stream_running", ())] == m[("mlx_stream_queue_depth", ())] == 0
