"""What an OpenAI-style request body may say, checked before anything runs (serving.server.http_app's routes
read bodies through here): the body is capped (413), max_tokens is capped (400), and every client
mistake (invalid UTF-8 or JSON, a misspelt field at the top level, inside a message or inside
stream_options, a field of the wrong type, a bad sampling parameter) is a RequestError with a one-line
message; sampling fields are checked once, by SamplingParams (the schema types the CLI flags use), and
a body becomes the one GenerationRequest (request_from_body), trusted after; the fields that change
nothing (model, user, metadata, store, stream_options) are type-checked all the same; `adapter` (which
base+adapter pair answers: serving.lora_pairs) must name a pair /v1/models lists, or be absent. A client
that hangs up while sending its body is serving.server.scheduler.ClientGone (one log line).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request
from starlette.requests import ClientDisconnect

from serving.backend import DEFAULT_MAX_TOKENS, SamplingParams, ServingError
from serving.chat_session import GenerationRequest
from serving.server.scheduler import DEFAULT_MAX_WAITING, DEFAULT_WAIT_S, ClientGone
from training.runfiles.json_records import JSONBoundError, loads
from training.runfiles.schema import SchemaError, reject_unknown
from training.text.chat_template import ROLES

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any context we serve
DEFAULT_MAX_TOKENS_CAP = 2048
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
# request-body fields: any other is refused with the nearest name, so a typo ("temprature") is not ignored
SAMPLING_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
                   "repeat_penalty", "seed", "stop", "stream")
CHAT_FIELDS, COMPLETION_FIELDS = ("messages",), ("prompt",)
IGNORED_FIELDS = ("model", "user", "stream_options", "metadata", "store")  # labels: they change no output
ADAPTER_FIELD = "adapter"  # which base+adapter pair answers (serving.lora_pairs); `model` stays a label
MESSAGE_FIELDS, PART_FIELDS, STREAM_OPTIONS = ("role", "content"), ("type", "text"), ("include_usage",)
MESSAGE_KEYS = frozenset(MESSAGE_FIELDS)
MAX_LABEL_CHARS = 512  # model, user, a metadata value (OpenAI's limit for metadata values)
MAX_METADATA = (16, 64)  # pairs, characters of a key: OpenAI's limits
NOOP_AT = {"n": (None, 1), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
           "logprobs": (None, False), "echo": (None, False), "best_of": (None, 1)}  # allowed only at these


class RequestError(ServingError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class ServerConfig:
    """The model name a server reports and the limits it holds every request to."""

    model_id: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    max_waiting: int = DEFAULT_MAX_WAITING  # requests that may wait for the model; more get a 503
    wait_s: float = DEFAULT_WAIT_S  # the longest a request waits for its turn before a 503


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes (413 beyond); ClientGone when the client hangs up mid-body."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is {declared} bytes; the limit is {limit}", 413)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(f"request body exceeds the {limit}-byte limit", 413)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected while sending the request body ({len(body)} bytes "
                         "received)") from None
    return bytes(body)


def parse_body(raw: bytes) -> dict:
    """A body as a JSON object (a 1 MiB body takes ~1 s of CPU here: called off the event loop)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = loads(text)  # the one bounded JSON reader: nesting depth, lone surrogates (training.runfiles.json_records)
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except JSONBoundError as e:
        raise RequestError(f"request body: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError("request body must be a JSON object")
    return obj


def _text(v: object, name: str) -> str:
    if not isinstance(v, str):
        raise RequestError(f"{name} must be a string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # JSON can smuggle lone surrogates ("\ud800") past the UTF-8 check
        raise RequestError(f"{name} is not valid UTF-8 (lone surrogate)") from None
    return v


def _known(kind: str, obj: dict, known: tuple[str, ...], where: str = "") -> None:
    try:
        reject_unknown(kind, obj, known, where)
    except SchemaError as e:
        raise RequestError(str(e)) from None


def _label(v: object, name: str) -> None:
    if len(_text(v, name)) > MAX_LABEL_CHARS:
        raise RequestError(f"{name} is limited to {MAX_LABEL_CHARS} characters")


def check_labels(body: dict) -> None:
    """The fields that change no output still have OpenAI's types (null: absent)."""
    for key in ("model", "user"):
        if body.get(key) is not None:
            _label(body[key], key)
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise RequestError("store must be true or false")
    meta = body.get("metadata")
    if meta is not None:
        pairs, key_chars = MAX_METADATA
        if not isinstance(meta, dict) or len(meta) > pairs:
            raise RequestError(f"metadata must be an object of at most {pairs} string values")
        for k, v in meta.items():
            if len(_text(k, "metadata key")) > key_chars:
                raise RequestError(f"metadata keys are limited to {key_chars} characters")
            _label(v, f"metadata[{json.dumps(k, ensure_ascii=False)}]")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError("stream_options must be an object")
        _known("field", opts, STREAM_OPTIONS, "stream_options")
        if opts.get("include_usage") is not None and not isinstance(opts["include_usage"], bool):
            raise RequestError("stream_options.include_usage must be true or false")
        if body.get("stream") is not True:
            raise RequestError("stream_options is only allowed with stream: true")


def check_fields(body: dict, endpoint_fields: tuple[str, ...]) -> None:
    """Refuse a misspelt or unsupported field (nearest name suggested) instead of ignoring it; OpenAI's
    fields that change nothing here are accepted at their no-op value only, and with their types."""
    for key, noop in NOOP_AT.items():
        if body.get(key) not in noop:
            raise RequestError(f"{key} = {json.dumps(body[key])} is not supported: only {key}={json.dumps(noop[-1])}")
    _known("field", body, (*endpoint_fields, *SAMPLING_FIELDS, *IGNORED_FIELDS, ADAPTER_FIELD, *NOOP_AT))
    check_labels(body)


def _stops(body: dict) -> tuple[str, ...]:
    """`stop` within the server's limits: a string or a list of at most MAX_STOP_STRINGS, each short."""
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (_text(stop, "stop"),)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS:
        stops = tuple(_text(s, "stop") for s in stop)
    else:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
    return stops


def sampling_from_body(body: dict, cap: int) -> SamplingParams:
    """OpenAI fields plus llama.cpp-style extensions (top_k, repeat_penalty / repetition_penalty), checked
    once, by SamplingParams itself (the schema types the CLI flags use; an error names the body's field),
    then held to the server's cap on max_tokens. Null is absent."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    rep_key = "repetition_penalty" if body.get("repetition_penalty") is not None else "repeat_penalty"
    stops = _stops(body)
    given = body.get(key)
    try:
        params = SamplingParams.from_user(
            {"max_new_tokens": key, "repetition_penalty": rep_key},
            max_new_tokens=min(DEFAULT_MAX_TOKENS, cap) if given is None else given,
            temperature=body.get("temperature"), top_k=body.get("top_k"), top_p=body.get("top_p"),
            repetition_penalty=body.get(rep_key), seed=body.get("seed"), stop=stops)
    except ServingError as e:
        raise RequestError(str(e)) from None
    if params.max_new_tokens > cap:
        raise RequestError(f"{key} must be in [1, {cap}], got {params.max_new_tokens}")
    return params


def request_from_body(body: dict, chat: bool, cap: int, adapters: tuple[str, ...]) -> GenerationRequest:
    """A chat (/v1/chat/completions) or completion (/v1/completions) body as the one GenerationRequest,
    every field checked here: trusted after."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    messages, prompt = (chat_messages(body), None) if chat else (None, completion_prompt(body))
    adapter = adapter_from_body(body, adapters)
    return GenerationRequest(sampling_from_body(body, cap), messages, prompt, adapter)


def stream_flag(body: dict) -> bool:
    s = body.get("stream", False)
    if not isinstance(s, bool):
        raise RequestError("stream must be true or false")
    return s


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object")
        if not m.keys() <= MESSAGE_KEYS:  # a dropped key would change the reply unseen
            _known("field", m, MESSAGE_FIELDS, f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            for j, p in enumerate(content):
                _known("field", p, PART_FIELDS, f"messages[{i}].content[{j}]")
            content = "".join(_text(p.get("text"), f"messages[{i}].content") for p in content)
        out.append({"role": m["role"], "content": _text(content, f"messages[{i}].content")})
    return out


def completion_prompt(body: dict) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    if not isinstance(p, str):
        raise RequestError("prompt must be a string (or a list holding one string)")
    return _text(p, "prompt")



def adapter_from_body(body: dict, known: tuple[str, ...]) -> str | None:
    """The `adapter` field: None (absent or null: the server's default pair), or one of `known` (the names
    /v1/models lists; none when the server serves no adapter). Checked here, once; trusted after."""
    v = body.get(ADAPTER_FIELD)
    if v is None:
        return None
    if not known:
        raise RequestError(f"{ADAPTER_FIELD}: this server serves no LoRA adapter (python -m serving BASE.gguf "
                           "--lora NAME=ADAPTER.gguf serves some); leave the field out")
    names = ", ".join(known)
    if not isinstance(v, str):
        raise RequestError(f"{ADAPTER_FIELD} must be one adapter's name (a string), one of: {names}")
    if v not in known:
        shown = json.dumps(v[:MAX_LABEL_CHARS])  # ASCII: a lone surrogate cannot break the reply
        raise RequestError(f"{ADAPTER_FIELD} {shown} is not served here; known: {names}")
    return v
