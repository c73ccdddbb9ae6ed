"""``mlx-stream server``: an OpenAI-compatible HTTP server over the speculative decode loop.

Routes (OpenAI's API; editors, chat front ends and the ``openai`` client plug in
unchanged): ``POST /v1/chat/completions`` (messages through the chat template),
``POST /v1/completions`` (a raw prompt), ``GET /v1/models``, ``GET /health``.
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
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .defaults import DEFAULT_HEADS, DEFAULT_MODEL

ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = {  # request fields answered with a 400 rather than silently ignored
    "echo": "the prompt is not echoed",
    "response_format": "no constrained (JSON) decoding",
    "best_of": "one completion per request",
    "suffix": "no insertion",
}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5


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
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


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


class Job:
    """One request in the engine's queue: its events come back to the event loop.

    Events are ``("step", GenerationResponse)``, then ``("end", None)``, or
    ``("error", APIError)``. ``cancel()`` stops the generation after the step in
    progress (or before it starts, if still queued).
    """

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
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
        heads, dtype, learn, draft_model: as :func:`mlx_stream.load` (``learn``: answers
            join this machine's store of the model's answers, which drafts draw on;
            ``draft_model``: a separate draft model drafts every request).
        cache_slots: prompt caches kept (conversations whose history is reused).
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
        **generation,
    ):
        if cache_slots < 1:
            raise ValueError(f"cache_slots must be >= 1, got {cache_slots}")
        self.generation, self.cache_slots = generation, cache_slots
        self.jobs: queue.Queue = queue.Queue()
        self.model = self.tokenizer = None
        # served / cancelled requests and tokens generated, for /health
        self.stats = {"served": 0, "cancelled": 0, "completion_tokens": 0}
        self.busy = False
        ready, failure = threading.Event(), []
        self.thread = threading.Thread(
            target=self._run,
            args=(model, heads, dtype, learn, draft_model, ready, failure),
            daemon=True,
            name="mlx-stream-engine",
        )
        self.thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _run(self, model, heads, dtype, learn, draft_model, ready, failure):
        from .generate import PromptCache
        from .loader import load

        try:
            self.model, self.tokenizer = load(
                model, heads=heads, dtype=dtype, learn=learn, draft_model=draft_model
            )
        except Exception as e:  # handed to the constructor, which raises it
            failure.append(e)
            ready.set()
            return
        self.caches = [PromptCache(self.model) for _ in range(self.cache_slots)]  # most recent first
        ready.set()
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self.stats["cancelled"] += 1
                continue
            self.busy = True
            self._serve(job)
            self.busy = False

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
        gen = None
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
            r = None
            for r in gen:
                job.put("step", r)
                if job.cancelled.is_set():
                    break
            job.put("end", None)
            self.stats["cancelled" if job.cancelled.is_set() and r.finish_reason is None else "served"] += 1
            self.stats["completion_tokens"] += r.generation_tokens
        except APIError as e:
            job.put("error", e)
        except ValueError as e:  # stream_generate's checks, before any forward pass
            code = "context_length_exceeded" if "context window" in str(e) else None
            job.put("error", APIError(str(e), param=param if code else None, code=code))
        except Exception as e:  # keep serving; the cache may be half updated: forget it
            self.caches[0].reset()
            job.put("error", APIError(f"generation failed: {e}", status=500, type="server_error"))
        finally:
            if gen is not None:
                gen.close()


def _token_text(tokenizer, t: int) -> str:
    return tokenizer.decode([t])


def _chat_logprobs(tokenizer, r) -> list[dict]:
    out = []
    for i, (t, lp) in enumerate(zip(r.tokens, r.logprobs)):
        s = _token_text(tokenizer, t)
        entry = {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
        if r.top_logprobs is not None:
            entry["top_logprobs"] = [
                {"token": (a := _token_text(tokenizer, j)), "logprob": v, "bytes": list(a.encode())}
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

    def __init__(self, req: GenRequest, tokenizer):
        self.req, self.tokenizer = req, tokenizer
        chat = req.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _logprobs(self, rs) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.kind == "chat":
            return {"content": [e for r in rs for e in _chat_logprobs(self.tokenizer, r)]}
        tokens, lps, tops, offsets, pos = [], [], [], [], 0
        for r in rs:
            for i, (t, lp) in enumerate(zip(r.tokens, r.logprobs)):
                s = _token_text(self.tokenizer, t)
                tokens.append(s)
                lps.append(lp)
                offsets.append(pos)
                pos += len(s)
                if r.top_logprobs is not None:
                    tops.append({_token_text(self.tokenizer, j): v for j, v in r.top_logprobs[i]})
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops if self.req.top_logprobs else None,
            "text_offset": offsets,
        }

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def whole(self, tally: _Tally, rs: list) -> dict:
        text, reason = "".join(tally.text), tally.last.finish_reason
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
        out = self._head(obj) | {"choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

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


def create_app(engine: Engine, model_id: str, max_tokens: int = 512, temp: float = 0.0) -> Starlette:
    """The ASGI application over ``engine``.

    Args:
        engine: the :class:`Engine` holding the model.
        model_id: the name ``/v1/models`` lists and requests may give.
        max_tokens, temp: defaults for requests that give none.
    """
    defaults = {"max_tokens": max_tokens, "temp": temp, "vocab_size": engine.model.args.vocab_size}

    async def body_of(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, too deep or too long
            raise APIError(f"the request body is not valid JSON: {str(e)[:200]}") from e

    async def complete(request: Request, kind: str):
        req = parse_request(await body_of(request), kind, model_id, defaults)
        job = Job(req, asyncio.get_running_loop())
        engine.submit(job)
        first = await _next_event(job, request)
        if first is None:
            return JSONResponse({}, status_code=499)  # the client is gone
        if first[0] == "error":
            raise first[1]
        fmt = _Completions(req, engine.tokenizer)
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

    async def models(request: Request):
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-stream"}],
            }
        )

    async def health(request: Request):
        return JSONResponse(
            {
                "status": "ok",
                "model": model_id,
                "busy": engine.busy,
                "queued": engine.jobs.qsize(),
                "requests": dict(engine.stats),
            }
        )

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

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={APIError: api_error, HTTPException: http_error},
    )


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
    **generation,
) -> None:
    """Load ``model`` (with ``heads``) and serve it over HTTP until interrupted.

    Args:
        model, heads, dtype, learn: as :func:`mlx_stream.load`.
        host, port: where to listen (127.0.0.1 by default: this machine only).
        max_tokens, temp: defaults for requests that give none.
        cache_slots: prompt caches kept (:class:`Engine`).
        **generation: ``tree``, ``prompt_lookup``, ``num_draft_tokens`` for
            :func:`mlx_stream.stream_generate`; ``draft_model``: for :func:`mlx_stream.load`.

    Raises:
        ValueError, FileNotFoundError: the model or heads cannot be loaded.
    """
    import uvicorn

    engine = Engine(model, heads=heads, dtype=dtype, cache_slots=cache_slots, learn=learn, **generation)
    app = create_app(engine, model, max_tokens=max_tokens, temp=temp)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.close()
