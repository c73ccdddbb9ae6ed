"""``mlx-stream server``: an OpenAI-compatible HTTP server over the speculative decode loop.

Routes (OpenAI's API; editors, chat front ends and the ``openai`` client plug in
unchanged): ``POST /v1/chat/completions`` (messages through the chat template),
``POST /v1/completions`` (a raw prompt), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health``, ``GET /metrics`` (Prometheus; both read one count, :class:`Stats`),
and ``GET /``: a chat page (one static file, no CDN) that streams through the API,
shades the text of accepted drafts and can stop a reply.
Non-streaming and streaming (server-sent events ending with ``data: [DONE]``).

One model in memory; one worker thread owns it and decodes the queued requests one at
a time with :func:`mlx_stream.stream_generate`, keeping a few
:class:`~mlx_stream.generate.PromptCache` slots (as mlx-lm server's prompt cache): a
request takes the slot whose history its prompt continues (else the least recently
used one) and reuses the common token prefix, so a conversation's next turn does not
recompute its history, also with several conversations interleaved.
Reuse is exact (keys/values of the same tokens at the same positions), so a request's
output does not depend on what ran before it. A client that disconnects stops its
generation at the end of the step in progress.

Request fields keep OpenAI's meaning (``max_tokens``/``max_completion_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``, ``logprobs``/``top_logprobs``,
``stream``, ``stream_options.include_usage``) plus mlx-lm server's extras ``top_k``,
``min_p``, ``repetition_penalty``; defaults for temperature and max_tokens come from
the server's options, as in ``mlx_lm.server``. Responses carry ``usage`` and
``finish_reason``, and the speculation figures in an extra ``speculation`` object
(``tau``: tokens per forward pass; ``drafted``/``accepted``: draft tokens verified and
kept; ``forward_passes``). Bad requests answer 400 with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``; unknown routes and models 404.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .defaults import DEFAULT_HEADS, DEFAULT_MODEL

ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = {  # request fields answered with a 400 rather than silently ignored
    "echo": "the prompt is not echoed",
    "best_of": "one completion per request",
    "suffix": "no insertion",
}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5
MAX_CHARS_PER_TOKEN = 64  # a prompt longer than this x the context window cannot fit: refused untokenised
OPEN_ROUTES = ("/health", "/")  # answered without an API key: probes, and the chat page (it asks for one)


@dataclass(frozen=True)
class ServerLimits:
    """What the server accepts from the network (llama-server's and vLLM's options).

    Attributes:
        api_keys: the keys a request may present as ``Authorization: Bearer KEY``;
            empty: no authentication (fine on 127.0.0.1, not on a network).
        max_queue: requests that may wait while one decodes; beyond it a request gets
            503 with ``Retry-After`` at once, its body unread.
        max_body_bytes: the largest request body; beyond it 413, checked from
            ``Content-Length`` and while reading, before parsing.

    Raises:
        ValueError: a negative ``max_queue``, a ``max_body_bytes`` below 1 KiB, or an
            empty API key.
    """

    api_keys: tuple[str, ...] = ()
    max_queue: int = 32
    max_body_bytes: int = 8 << 20

    def __post_init__(self):
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError("API keys must be non-empty strings")

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries one of the keys (compared in
        constant time, every key tried, so timing tells nothing about any key)."""
        if not self.api_keys:
            return True
        scheme, _, token = (header or "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(given, key.encode())
        return ok


class APIError(Exception):
    """An error answered with OpenAI's error body.

    Attributes:
        status: the HTTP status (400 bad request, 404 unknown model or route, 500).
        message, type, param, code: the fields of ``{"error": {...}}``.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


@dataclass
class GenRequest:
    """A validated request: what to decode and how to answer.

    Attributes:
        kind: ``"chat"`` (``messages`` through the chat template) or ``"completion"``
            (``prompt``: text or token ids).
        settings: keyword arguments of :func:`mlx_stream.stream_generate`
            (``max_tokens``, ``temp``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
            ``stop``, ``top_logprobs``, ``logits_processors``).
        logprobs: answer each token's log-probability.
        top_logprobs: alternatives answered per token (0 = none).
    """

    kind: str
    model: str
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    settings: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    template: dict = field(default_factory=dict)  # extra chat-template arguments (tools, ...)
    logprobs: bool = False
    top_logprobs: int = 0


def _number(body: dict, name: str, default, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(name)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    try:
        finite = integer or math.isfinite(v) and abs(v) < 1e300
    except (OverflowError, TypeError):  # an int too large for a float
        finite = False
    if isinstance(v, bool) or not ok or not finite or (integer and abs(v) >= 2**62):
        shown = json.dumps(v) if not isinstance(v, int) or abs(v) < 10**30 else "a huge integer"
        raise APIError(f"'{name}' must be {kind} in range, got {shown}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise APIError(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise APIError(f"'{name}' must be <= {hi}, got {v}", param=name)
    return v


def _utf8(text: str, param: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"'{param}' is not valid Unicode text ({e.reason} at {e.start})", param=param) from e
    return text


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return _utf8(content, f"messages[{i}].content")
    if isinstance(content, list):  # content parts: only text parts are supported
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(
                    f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                    param=f"messages[{i}].content",
                )
            texts.append(_utf8(part["text"], f"messages[{i}].content"))
        return "".join(texts)
    if content is None:
        return ""
    raise APIError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def parse_request(body, kind: str, model_id: str, defaults: dict) -> GenRequest:
    """Validate an OpenAI request body (already parsed JSON).

    Args:
        body: the request's JSON value.
        kind: ``"chat"`` or ``"completion"``.
        model_id: the served model's id; a request naming another model is refused.
        defaults: ``{"max_tokens", "temp"}`` for requests that give none, and optionally
            ``"vocab_size"`` (token ids in ``logit_bias`` and ``top_k`` are checked against it).

    Returns:
        :class:`GenRequest`.

    Raises:
        APIError: 400 naming the first field that is missing or out of range; 404 for
            another model's name.
    """
    from .sampling import SamplingParams, make_processors

    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    if model is not None and model not in (model_id, "default_model"):
        raise APIError(
            f"The model '{model}' does not exist; this server serves '{model_id}' (GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )
    req = GenRequest(kind=kind, model=model_id)
    if kind == "chat":
        msgs = body.get("messages")
        if msgs is None:
            raise APIError("'messages' is required", param="messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        req.messages = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise APIError(
                    f"messages[{i}] must be an object with a 'role' in {', '.join(ROLES)}", param="messages"
                )
            role = "system" if m["role"] == "developer" else m["role"]
            msg = {"role": role, "content": _message_text(m.get("content"), i)}
            for key in ("name", "tool_calls", "tool_call_id"):  # for templates that render tools
                if m.get(key) is not None:
                    msg[key] = m[key]
            req.messages.append(msg)
        for key in ("tools", "chat_template_kwargs"):
            v = body.get(key)
            if v is not None and not isinstance(v, list if key == "tools" else dict):
                raise APIError(f"'{key}' must be {'a list' if key == 'tools' else 'an object'}", param=key)
        req.template = {"tools": body.get("tools")} | (body.get("chat_template_kwargs") or {})
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if p is None:
            raise APIError("'prompt' is required", param="prompt")
        if isinstance(p, list):
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                raise APIError(
                    "'prompt' must be a string, or a non-empty list of token ids (one prompt per request)",
                    param="prompt",
                )
        elif not isinstance(p, str) or not p:
            raise APIError("'prompt' must be a non-empty string or a list of token ids", param="prompt")
        else:
            _utf8(p, "prompt")
        req.prompt = p
    if body.get("n") not in (None, 1):
        raise APIError("only n = 1 is supported", param="n")
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False):
            raise APIError(f"'{key}' is not supported by this server ({why})", param=key)
    fmt = body.get("response_format")
    # {"type": "text"} is OpenAI's default (plain text), which some clients send explicitly
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(
            "'response_format' is not supported by this server (no constrained (JSON) decoding; "
            'only {"type": "text"}, the default, is accepted)',
            param="response_format",
        )
    max_tokens = _number(body, "max_tokens", defaults["max_tokens"], lo=1, integer=True)
    max_tokens = _number(body, "max_completion_tokens", max_tokens, lo=1, integer=True)
    temp = _number(body, "temperature", defaults["temp"], lo=0)
    top_p = _number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
    top_k = _number(body, "top_k", 0, lo=0, integer=True)
    min_p = _number(body, "min_p", 0.0, lo=0, hi=1)
    penalty = _number(body, "repetition_penalty", None, lo=0, lo_open=True)
    presence = _number(body, "presence_penalty", None, lo=-2, hi=2)
    frequency = _number(body, "frequency_penalty", None, lo=-2, hi=2)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise APIError("'logit_bias' must be an object of token id -> bias", param="logit_bias")
        try:
            bias = {int(k): v for k, v in bias.items()}
        except ValueError as e:
            raise APIError("'logit_bias' keys must be token ids", param="logit_bias") from e
        for v in bias.values():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise APIError("'logit_bias' values must be numbers in [-100, 100]", param="logit_bias")
    seed = _number(body, "seed", None, lo=0, integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError("'stop' must be a string or a list of strings", param="stop")
    for s in stop or []:
        _utf8(s, "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError("'stream' must be true or false", param="stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise APIError("'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise APIError("'stream_options' must be {\"include_usage\": true|false}", param="stream_options")
        req.include_usage = opts.get("include_usage", False)
    if kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise APIError("'logprobs' must be true or false", param="logprobs")
        req.logprobs = bool(lp)
        req.top_logprobs = _number(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        if req.top_logprobs and not req.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:  # completions: logprobs is the number of alternatives (0..5)
        lp = _number(body, "logprobs", None, lo=0, hi=5, integer=True)
        req.logprobs, req.top_logprobs = lp is not None, lp or 0
    req.stream = stream
    try:
        vocab = defaults.get("vocab_size")
        processors = make_processors(
            penalty, logit_bias=bias, presence_penalty=presence, frequency_penalty=frequency, vocab_size=vocab
        )
        SamplingParams(float(temp), float(top_p), top_k, float(min_p)).check(vocab)
    except ValueError as e:
        raise APIError(str(e)) from e
    req.settings = {
        "max_tokens": max_tokens,
        "temp": float(temp),
        "top_p": float(top_p),
        "top_k": top_k,
        "min_p": float(min_p),
        "seed": seed,
        "stop": stop,
        "top_logprobs": req.top_logprobs,
        "logits_processors": processors,
    }
    return req


OUTCOMES = ("served", "timed_out", "cancelled", "failed")  # how a request the engine took ended


class Stats:
    """The server's counts, kept in one place: the engine's worker updates them as each
    request starts, produces its first token and ends; ``GET /health`` and ``GET /metrics``
    both read them (under one lock), so the two always agree.

    Every request that reached the engine's queue ends with exactly one outcome:

    - ``served``: decoded to its end (``finish_reason`` stop or length) and answered;
    - ``timed_out``: ended by the request timeout (answered as a length stop);
    - ``cancelled``: its client went away first (while queued, or mid-way: the generation
      stops after the step in progress);
    - ``failed``: ended with an error (a prompt or chat template refused, a failure).

    ``prompt_tokens`` and ``completion_tokens`` add up every request that began decoding,
    whatever its outcome: the prompt (cached tokens included, as ``usage.prompt_tokens``)
    and the tokens generated (for an answered request its ``usage.completion_tokens``; for
    a cancelled one, what it generated before it stopped). ``running`` (0 or 1) and
    ``queued`` add up to the requests submitted and not ended. Per request that generated
    a token: time to first token, request seconds and tau histograms (their counts agree
    once it ends).

    It is a Prometheus collector: register it in a ``CollectorRegistry``.
    """

    def __init__(self):
        from prometheus_client import Histogram

        self.lock = threading.RLock()
        self.counts = dict.fromkeys((*OUTCOMES, "prompt_tokens", "completion_tokens"), 0)
        self.pending = 0  # submitted and not ended: the one decoding plus those queued
        self.running = 0
        seconds = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
        self.ttft = Histogram(
            "mlx_stream_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            buckets=seconds,
            registry=None,
        )
        self.latency = Histogram(
            "mlx_stream_request_seconds", "From arrival to the last token", buckets=seconds, registry=None
        )
        self.tau = Histogram(
            "mlx_stream_tau",
            "Tokens per target forward pass, per request",
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0),
            registry=None,
        )
        self.recent: list[float] = []  # the latest requests' seconds (Retry-After's estimate)

    def submitted(self) -> None:
        """A request joined the queue."""
        with self.lock:
            self.pending += 1

    def started(self) -> None:
        """The worker took a request from the queue and decodes it."""
        with self.lock:
            self.running = 1

    def first_token(self, arrived: float) -> None:
        """A request produced its first token (``arrived``: its ``time.monotonic()``)."""
        with self.lock:
            self.ttft.observe(time.monotonic() - arrived)

    def ended(self, outcome: str, arrived: float, last=None) -> None:
        """A request ended with ``outcome`` (one of :data:`OUTCOMES`); ``last``: its last
        ``GenerationResponse`` (None if it generated nothing)."""
        with self.lock:
            self.counts[outcome] += 1
            self.pending -= 1
            self.running = 0
            if last is not None:
                took = time.monotonic() - arrived
                self.counts["prompt_tokens"] += last.prompt_tokens
                self.counts["completion_tokens"] += last.generation_tokens
                self.latency.observe(took)
                self.tau.observe(last.tau)
                self.recent = (self.recent + [took])[-16:]

    def snapshot(self) -> dict:
        """The counts, ``running`` and ``queued``, as of one moment."""
        with self.lock:
            return dict(self.counts) | {"running": self.running, "queued": self.pending - self.running}

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one request's time here."""
        with self.lock:
            recent = sorted(self.recent)
        return max(1, min(300, math.ceil(recent[len(recent) // 2]))) if recent else 1

    def collect(self) -> list:
        """The Prometheus metrics (the collector protocol), all as of one moment."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self.lock:
            s = self.snapshot()
            ended = CounterMetricFamily(
                "mlx_stream_engine_requests",
                "Requests the engine took from its queue, by how they ended",
                labels=["outcome"],
            )
            for outcome in OUTCOMES:
                ended.add_metric([outcome], s[outcome])
            return [
                ended,
                CounterMetricFamily(
                    "mlx_stream_prompt_tokens",
                    "Prompt tokens of the requests decoded",
                    value=s["prompt_tokens"],
                ),
                CounterMetricFamily(
                    "mlx_stream_completion_tokens",
                    "Tokens generated (also those of requests whose client went away)",
                    value=s["completion_tokens"],
                ),
                GaugeMetricFamily("mlx_stream_queue_depth", "Requests waiting", value=s["queued"]),
                GaugeMetricFamily("mlx_stream_running", "Requests decoding", value=s["running"]),
                *(m for hist in (self.ttft, self.latency, self.tau) for m in hist.collect()),
            ]


class Job:
    """One request in the engine's queue: its events come back to the event loop.

    Events are ``("step", GenerationResponse)``, then ``("end", None)``, or
    ``("error", APIError)``. ``cancel()`` stops the generation after the step in
    progress (or before it starts, if still queued). ``arrived``: the request's arrival
    (``time.monotonic()``; default: now), for the time to first token.
    """

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop, arrived: float | None = None):
        self.request, self.loop = request, loop
        self.arrived = time.monotonic() if arrived is None else arrived
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.checked = time.monotonic()  # last check that the client is still there

    def put(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """The model and its decode loop on one worker thread, serving :class:`Job` s in order.

    The model is loaded on the worker thread (MLX work stays on one thread); the
    constructor returns once it is loaded.

    Args:
        model: model spec for :func:`mlx_stream.load`.
        heads, dtype, learn, draft_model, draft_p_min: as :func:`mlx_stream.load` (``learn``:
            answers join this machine's store of the model's answers, which drafts draw on;
            ``draft_model``: a separate draft model drafts every request).
        cache_slots: prompt caches kept (conversations whose history is reused).
        request_timeout: seconds a request may decode; then it ends as if ``max_tokens``
            were reached (``finish_reason`` ``"length"``); None: no limit.
        generation: fixed keyword arguments of :func:`mlx_stream.stream_generate`
            for every request (``tree``, ``prompt_lookup``, ``num_draft_tokens``).

    Raises:
        ValueError, FileNotFoundError: the model or heads cannot be loaded.
    """

    def __init__(
        self,
        model: str,
        heads: str = DEFAULT_HEADS,
        dtype: str = "auto",
        cache_slots: int = 4,
        learn: bool = False,
        draft_model: str | None = None,
        request_timeout: float | None = None,
        draft_p_min: float | None = None,
        **generation,
    ):
        if cache_slots < 1:
            raise ValueError(f"cache_slots must be >= 1, got {cache_slots}")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds or None, got {request_timeout!r}")
        self.generation, self.cache_slots, self.request_timeout = generation, cache_slots, request_timeout
        self.jobs: queue.Queue = queue.Queue()
        self.model = self.tokenizer = None
        self.stats = Stats()  # what /health and /metrics report
        ready, failure = threading.Event(), []
        self.thread = threading.Thread(
            target=self._run,
            args=(model, heads, dtype, learn, draft_model, draft_p_min, ready, failure),
            daemon=True,
            name="mlx-stream-engine",
        )
        self.thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def submit(self, job: Job) -> None:
        """Queue ``job``; its events come back through ``job.events``."""
        self.stats.submitted()
        self.jobs.put(job)

    @property
    def pending(self) -> int:
        """Requests submitted and not finished: the one decoding plus those queued."""
        return self.stats.pending

    @property
    def busy(self) -> bool:
        """Whether a request is decoding."""
        return self.stats.running > 0

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _run(self, model, heads, dtype, learn, draft_model, draft_p_min, ready, failure):
        from .generate import PromptCache
        from .loader import load

        try:
            self.model, self.tokenizer = load(
                model, heads=heads, dtype=dtype, learn=learn, draft_model=draft_model, draft_p_min=draft_p_min
            )
        except Exception as e:  # handed to the constructor, which raises it
            failure.append(e)
            ready.set()
            return
        self.caches = [PromptCache(self.model) for _ in range(self.cache_slots)]  # most recent first
        self.token_bytes = token_bytes(self.tokenizer)
        ready.set()
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                self.stats.ended("cancelled", job.arrived)
                continue
            self.stats.started()
            self._serve(job)  # (ends it in the stats, whatever happens)

    def _prompt(self, req: GenRequest):
        if req.kind == "completion":
            return req.prompt
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        try:
            return self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # the template's own error (jinja), e.g. roles out of order
            raise APIError(f"the chat template refused these messages: {e}", param="messages") from e

    def _cache_for(self, ids: list[int]):
        # the slot this prompt continues (its history is all, or nearly all, a prefix of
        # the prompt: the longest such), else the least recently used slot; to the front
        best, best_len = len(self.caches) - 1, -1
        for i, c in enumerate(self.caches):
            n = c.shared_prefix(ids)
            if n >= 0.9 * len(c.tokens) and n > best_len:
                best, best_len = i, n
        cache = self.caches.pop(best)
        self.caches.insert(0, cache)
        return cache

    def _serve(self, job: Job) -> None:
        from .generate import encode_prompt, stream_generate

        req = job.request
        param = "messages" if req.kind == "chat" else "prompt"
        gen = last = None
        outcome, final = "failed", ("error", APIError("generation failed", status=500, type="server_error"))
        try:
            try:
                ids = encode_prompt(self.tokenizer, self._prompt(req), self.model.args.vocab_size)
            except ValueError as e:
                raise APIError(str(e), param="prompt") from e
            cache = self._cache_for(ids)
            gen = stream_generate(
                self.model,
                self.tokenizer,
                ids,
                prompt_cache=cache,
                **(self.generation | req.settings),
            )
            deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
            outcome = "served"
            for r in gen:
                if last is None:
                    self.stats.first_token(job.arrived)
                last = r
                job.put("step", r)
                if job.cancelled.is_set():
                    if r.finish_reason is None:  # (after the last step: answered in full)
                        outcome = "cancelled"
                    break
                if deadline is not None and r.finish_reason is None and time.monotonic() > deadline:
                    outcome = "timed_out"
                    break  # answered as a length stop (the formatter ends the choice)
            final = ("end", None)
        except APIError as e:
            final = ("error", e)
        except ValueError as e:  # stream_generate's checks, before any forward pass
            code = "context_length_exceeded" if "context window" in str(e) else None
            final = ("error", APIError(str(e), param=param if code else None, code=code))
        except Exception as e:  # keep serving; the cache may be half updated: forget it
            self.caches[0].reset()
            final = ("error", APIError(f"generation failed: {e}", status=500, type="server_error"))
        finally:
            if gen is not None:
                gen.close()
            if final[0] == "error":
                outcome = "failed"
            # counted before the client hears the end: once it has its answer, /health and
            # /metrics include it
            self.stats.ended(outcome, job.arrived, last)
            job.put(*final)


def _token_text(tokenizer, t: int) -> str:
    return tokenizer.decode([t])


def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's own bytes, as OpenAI's logprob ``bytes`` field carries them: joining
    the bytes of a text's tokens rebuilds its UTF-8 exactly, also where one character
    spans several tokens (an emoji, CJK text), which decoding each token alone cannot.

    Byte-level BPE tokens (GPT-2's byte-to-character map, mlx-lm's ``BPEStreamingDetokenizer``)
    map back to their raw bytes; SentencePiece tokens have ``\u2581`` as a space and
    ``<0xNN>`` byte tokens are that byte (mlx-lm's ``SPMStreamingDetokenizer`` table);
    other tokenizers fall back to each token's decoded text.

    Returns:
        ``bytes`` per token id, ``len(tokenizer)`` of them.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    det = getattr(tokenizer, "_detokenizer", None)
    if isinstance(det, SPMStreamingDetokenizer):
        return [b.replace("\u2581".encode(), b" ") for b in det.tokenmap]
    if isinstance(det, BPEStreamingDetokenizer):
        from mlx_lm.tokenizer_utils import _byte_decoder

        table = _byte_decoder()
        return [
            b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece or "")
            for piece in det.tokenmap
        ]
    return [tokenizer.decode([t]).encode() for t in range(len(tokenizer))]


def _chat_logprobs(tokenizer, r, table: list[bytes]) -> list[dict]:
    def raw(t):
        return list(table[t]) if t < len(table) else list(_token_text(tokenizer, t).encode())

    out = []
    for i, (t, lp) in enumerate(zip(r.tokens, r.logprobs)):
        entry = {"token": _token_text(tokenizer, t), "logprob": lp, "bytes": raw(t), "top_logprobs": []}
        if r.top_logprobs is not None:
            entry["top_logprobs"] = [
                {"token": _token_text(tokenizer, j), "logprob": v, "bytes": raw(j)}
                for j, v in r.top_logprobs[i]
            ]
        out.append(entry)
    return out


@dataclass
class _Tally:
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    last: object = None

    def add(self, r) -> None:
        self.text.append(r.text)
        self.tokens.extend(r.tokens)
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.last = r

    def usage(self) -> dict:
        r = self.last
        return {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.generation_tokens,
            "total_tokens": r.prompt_tokens + r.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
        }

    def speculation(self) -> dict:
        r = self.last
        return {
            "tau": round(r.tau, 4),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "forward_passes": r.forward_passes,
            "generation_tps": round(r.generation_tps, 2),
        }


class _Completions:
    """Turns one job's events into OpenAI responses (whole or streamed)."""

    def __init__(self, req: GenRequest, tokenizer, table: list[bytes]):
        self.req, self.tokenizer, self.table = req, tokenizer, table
        chat = req.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _logprobs(self, rs) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.kind == "chat":
            return {"content": [e for r in rs for e in _chat_logprobs(self.tokenizer, r, self.table)]}
        tokens, lps, tops, offsets, pos = [], [], [], [], 0
        for r in rs:
            for i, (t, lp) in enumerate(zip(r.tokens, r.logprobs)):
                tokens.append(self._legacy_token(t))
                lps.append(lp)
                offsets.append(pos)
                pos += len(_token_text(self.tokenizer, t))
                if r.top_logprobs is not None:
                    tops.append({self._legacy_token(j): v for j, v in r.top_logprobs[i]})
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops if self.req.top_logprobs else None,
            "text_offset": offsets,
        }

    def _legacy_token(self, t: int) -> str:
        # the completions API's token strings: the token's text, or where its bytes are only
        # part of a character, "bytes:\\xNN..." (OpenAI's form) so that they still join exactly
        raw = self.table[t] if t < len(self.table) else _token_text(self.tokenizer, t).encode()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def whole(self, tally: _Tally, rs: list) -> dict:
        text, reason = "".join(tally.text), tally.last.finish_reason or "length"
        if self.req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": self._logprobs(rs), "finish_reason": reason}
        return self._head(self.object) | {
            "choices": [choice],
            "usage": tally.usage(),
            "speculation": tally.speculation(),
        }

    def chunk(self, r, first: bool) -> dict:
        if self.req.kind == "chat":
            delta = {"role": "assistant", "content": r.text} if first else {"content": r.text}
            if r.finish_reason is not None and not r.text:
                delta = {"role": "assistant"} if first else {}
            choice = {"index": 0, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": r.text}, "text_completion"
        choice |= {"logprobs": self._logprobs([r]), "finish_reason": r.finish_reason}
        # an extra field (OpenAI clients ignore it): this step's tokens, and how many of them
        # were drafts the target accepted (the chat page marks that text)
        out = self._head(obj) | {
            "choices": [choice],
            "mlx_stream": {"tokens": len(r.tokens), "drafted": r.accepted},
        }
        if self.req.include_usage:
            out["usage"] = None
        return out

    def final_chunk(self) -> dict:
        # a choice the server ended (the request's timeout): no text, finish_reason "length"
        if self.req.kind == "chat":
            choice, obj = {"index": 0, "delta": {}}, "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": ""}, "text_completion"
        out = self._head(obj) | {"choices": [choice | {"logprobs": None, "finish_reason": "length"}]}
        return out | ({"usage": None} if self.req.include_usage else {})

    def usage_chunk(self, tally: _Tally) -> dict:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return self._head(obj) | {"choices": [], "usage": tally.usage(), "speculation": tally.speculation()}


async def _next_event(job: Job, request: Request, poll: float = 0.1):
    # the job's next event; cancels the job (and returns None) if the client went away
    # (checked at least every ``poll`` seconds, also while events keep coming)
    while True:
        now = time.monotonic()
        if now - job.checked >= poll:
            job.checked = now
            if await request.is_disconnected():
                job.cancel()
                return None
        try:
            return await asyncio.wait_for(job.events.get(), poll)
        except asyncio.TimeoutError:
            pass


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(job: Job, first, fmt: _Completions, request: Request) -> AsyncIterator[str]:
    tally = _Tally()
    event, is_first = first, True
    try:
        while event is not None:
            kind, value = event
            if kind == "error":  # after the stream began: the error as the last event
                body = {
                    "message": value.message,
                    "type": value.type,
                    "param": value.param,
                    "code": value.code,
                }
                yield _sse({"error": body})
                break
            if kind == "end":
                if tally.last is not None and tally.last.finish_reason is None:  # stopped by the timeout
                    yield _sse(fmt.final_chunk())
                if fmt.req.include_usage and tally.last is not None:
                    yield _sse(fmt.usage_chunk(tally))
                yield "data: [DONE]\n\n"
                break
            tally.add(value)
            chunk = fmt.chunk(value, is_first)
            if value.finish_reason is not None:
                chunk["speculation"] = tally.speculation()
            is_first = False
            yield _sse(chunk)
            event = await _next_event(job, request)
    finally:  # the client went away (or the stream ended): stop the generation
        job.cancel()


class _Metrics:
    """The server's Prometheus metrics (``GET /metrics``), in a registry of its own: the
    answers by route and status (counted at the HTTP layer), and the engine's
    :class:`Stats` (requests by outcome, tokens, queue, latency and tau)."""

    def __init__(self, engine: Engine):
        from prometheus_client import CollectorRegistry, Counter

        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlx_stream_requests",
            "HTTP requests answered, by route and status (499: the client left before the answer)",
            ["route", "status"],
            registry=r,
        )
        r.register(engine.stats)  # its counts are read as /health reads them, at one moment

    def render(self) -> bytes:
        """The Prometheus text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return v.decode("latin-1")
    return None


class _Guard:
    # ASGI middleware in front of every route: the API key (401 before anything is read)
    # and the count of answers by route and status
    routes = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/v1/models")
    model_route = "/v1/models/{id}"  # GET /v1/models/ID, counted under one label

    def __init__(self, app, limits: ServerLimits, metrics: _Metrics):
        self.app, self.limits, self.metrics = app, limits, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], {}
        route = path if path in self.routes + OPEN_ROUTES + ("/metrics",) else "other"
        if path.startswith("/v1/models/"):
            route = self.model_route

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if path not in OPEN_ROUTES and not self.limits.authorized(_header(scope, b"authorization")):
                err = APIError(
                    "Incorrect or missing API key: send the header 'Authorization: Bearer KEY' with a key "
                    "the server was started with (--api-key)",
                    status=401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await err.response()(scope, receive, send_status)
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(route, str(status.get("code", 499))).inc()


async def _read_body(request: Request, limit: int) -> bytes:
    # the body, refused (413) past ``limit`` bytes: from Content-Length before reading, and
    # while reading (a chunked body, or a header that lies)
    too_big = APIError(
        f"the request body is larger than this server accepts ({limit / (1 << 20):.1f} MB; --max-body-mb)",
        status=413,
        code="request_too_large",
    )
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt_chars(req: GenRequest) -> int:
    if req.kind == "completion":
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    return sum(len(m.get("content") or "") for m in req.messages or [] if isinstance(m.get("content"), str))


def create_app(
    engine: Engine,
    model_id: str,
    max_tokens: int = 512,
    temp: float = 0.0,
    limits: ServerLimits | None = None,
):
    """The ASGI application over ``engine``.

    Args:
        engine: the :class:`Engine` holding the model.
        model_id: the name ``/v1/models`` lists and requests may give.
        max_tokens, temp: defaults for requests that give none.
        limits: API keys, the queue bound and the body cap (:class:`ServerLimits`);
            None: the defaults, no API key.
    """
    limits = limits or ServerLimits()
    metrics = _Metrics(engine)
    defaults = {"max_tokens": max_tokens, "temp": temp, "vocab_size": engine.model.args.vocab_size}
    ctx = engine.model.context_length

    async def body_of(request: Request):
        raw = await _read_body(request, limits.max_body_bytes)
        try:  # a large body is parsed off the event loop, which keeps serving the others
            return json.loads(raw) if len(raw) < 1 << 16 else await asyncio.to_thread(json.loads, raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, too deep or too long
            raise APIError(f"the request body is not valid JSON: {str(e)[:200]}") from e

    async def complete(request: Request, kind: str):
        started = time.monotonic()
        if engine.pending > limits.max_queue:  # one decoding and max_queue waiting: busy
            raise APIError(
                f"the server is overloaded: {engine.pending} requests in progress or queued "
                f"(--max-queue {limits.max_queue}); retry later",
                status=503,
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(engine.stats.retry_after())},
            )
        req = parse_request(await body_of(request), kind, model_id, defaults)
        if ctx is not None and _prompt_chars(req) > ctx * MAX_CHARS_PER_TOKEN:
            raise APIError(
                f"the prompt has {_prompt_chars(req)} characters, more than the model's context window of "
                f"{ctx} tokens can hold: shorten it",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        # (the engine counts the request, its tokens and times: Stats, what /health and /metrics read)
        job = Job(req, asyncio.get_running_loop(), arrived=started)
        engine.submit(job)
        first = await _next_event(job, request)
        if first is None:
            return JSONResponse({}, status_code=499)  # the client is gone
        if first[0] == "error":
            raise first[1]
        fmt = _Completions(req, engine.tokenizer, engine.token_bytes)
        if req.stream:
            return StreamingResponse(
                _stream(job, first, fmt, request),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        tally, rs, event = _Tally(), [], first
        while event is not None and event[0] == "step":
            tally.add(event[1])
            rs.append(event[1])
            event = await _next_event(job, request)
        if event is None:
            return JSONResponse({}, status_code=499)
        if event[0] == "error":
            raise event[1]
        return JSONResponse(fmt.whole(tally, rs))

    async def chat_completions(request: Request):
        return await complete(request, "chat")

    async def completions(request: Request):
        return await complete(request, "completion")

    model_object = {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-stream"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_object]})

    async def model_info(request: Request):
        # GET /v1/models/ID (the client's models.retrieve); the id may hold slashes (a path)
        if request.path_params["model"] not in (model_id, "default_model"):
            raise APIError(
                f"The model '{request.path_params['model']}' does not exist; this server serves "
                f"'{model_id}' (GET /v1/models)",
                status=404,
                code="model_not_found",
            )
        return JSONResponse(model_object)

    async def health(request: Request):
        s = engine.stats.snapshot()  # the numbers /metrics reports, from one moment
        return JSONResponse(
            {
                "status": "ok",
                "model": model_id,
                "busy": s["running"] > 0,
                "running": s["running"],
                "queued": s["queued"],
                "max_queue": limits.max_queue,
                "requests": {k: s[k] for k in (*OUTCOMES, "prompt_tokens", "completion_tokens")},
            }
        )

    async def chat_page(request: Request):
        from importlib.resources import files

        return HTMLResponse(files("mlx_stream").joinpath("data/chat.html").read_text(encoding="utf-8"))

    async def metrics_route(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, exc: APIError):
        return exc.response()

    async def http_error(request: Request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error"
        )
        msg = {
            404: f"unknown route {request.method} {request.url.path}",
            405: f"{request.method} is not allowed here",
        }
        return APIError(
            msg.get(exc.status_code, str(exc.detail)), status=exc.status_code, type=kind
        ).response()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model_info, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
            Route("/", chat_page, methods=["GET"]),
        ],
        exception_handlers={APIError: api_error, HTTPException: http_error},
    )
    return _Guard(app, limits, metrics)


def serve(
    model: str = DEFAULT_MODEL,
    heads: str = DEFAULT_HEADS,
    host: str = "127.0.0.1",
    port: int = 8080,
    dtype: str = "auto",
    max_tokens: int = 512,
    temp: float = 0.0,
    log_level: str = "info",
    cache_slots: int = 4,
    learn: bool = False,
    limits: ServerLimits | None = None,
    request_timeout: float | None = None,
    **generation,
) -> None:
    """Load ``model`` (with ``heads``) and serve it over HTTP until interrupted.

    Args:
        model, heads, dtype, learn: as :func:`mlx_stream.load`.
        host, port: where to listen (127.0.0.1 by default: this machine only); another
            address without an API key prints a warning.
        max_tokens, temp: defaults for requests that give none.
        cache_slots: prompt caches kept (:class:`Engine`).
        limits: API keys, the queue bound, the body cap (:class:`ServerLimits`).
        request_timeout: seconds a request may decode (:class:`Engine`).
        **generation: ``tree``, ``prompt_lookup``, ``num_draft_tokens`` for
            :func:`mlx_stream.stream_generate`; ``draft_model``, ``draft_p_min``: for
            :func:`mlx_stream.load`.

    Raises:
        ValueError, FileNotFoundError: the model or heads cannot be loaded.
    """
    import sys

    import uvicorn

    limits = limits or ServerLimits()
    if not limits.api_keys and host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving on {host} without an API key: anyone who can reach this port can use the "
            "model; pass --api-key KEY (or set MLX_STREAM_API_KEY)",
            file=sys.stderr,
        )
    engine = Engine(
        model,
        heads=heads,
        dtype=dtype,
        cache_slots=cache_slots,
        learn=learn,
        request_timeout=request_timeout,
        **generation,
    )
    app = create_app(engine, model, max_tokens=max_tokens, temp=temp, limits=limits)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.close()
