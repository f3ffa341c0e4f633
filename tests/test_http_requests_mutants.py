"""serving/server/http_requests.py in-process (issue #46 item 3, mutation target `http-requests`): what an
OpenAI-style request body may say, as the module's contract and docs/serving.md state it. The body is
capped (413) and max_tokens is capped (400); every client mistake (invalid UTF-8 or JSON, a misspelt
field at the top level, inside a message or inside stream_options, a field of the wrong type, a bad
sampling parameter) is one RequestError; the fields that change no output (model, user, metadata,
store, stream_options) are type-checked all the same, at OpenAI's limits (512 characters for a label or
metadata value, 16 metadata pairs, 64-character keys); OpenAI fields we do not implement (n,
frequency_penalty, ...) are accepted at their no-op value only. test_http.py checks the same through
servers on a model; these call the parsers directly (no model, no server).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import ClientDisconnect

from serving.backend import SamplingParams
from serving.server.http_requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS_CAP,
    RequestError,
    ServerConfig,
    chat_messages,
    check_fields,
    completion_prompt,
    parse_body,
    read_body,
    sampling_from_body,
    stream_flag,
)
from serving.server.scheduler import DEFAULT_MAX_WAITING, DEFAULT_WAIT_S, ClientGone


def refused(fn, *args, status: int = 400) -> str:
    with pytest.raises(RequestError) as e:
        fn(*args)
    assert e.value.status == status
    return str(e.value)


# --------------------------------------------------------------------------- the body
class FakeRequest:
    def __init__(self, chunks: list[bytes], declared: str | None = None, hang_up: bool = False) -> None:
        self.headers = {} if declared is None else {"content-length": declared}
        self.chunks, self.hang_up, self.read = chunks, hang_up, 0

    async def stream(self):
        for c in self.chunks:
            self.read += 1
            yield c
        if self.hang_up:
            raise ClientDisconnect()


def body_of(req: FakeRequest, limit: int) -> bytes:
    return asyncio.run(read_body(req, limit))


def test_a_body_up_to_the_limit_is_read_whole():
    assert body_of(FakeRequest([b"ab", b"cd"], declared="4"), 4) == b"abcd"
    assert body_of(FakeRequest([b"abcd"]), 4) == b"abcd"  # no content-length: counted as it arrives
    assert body_of(FakeRequest([b"ab"], declared="chunked?"), 4) == b"ab"  # a header that is no number


def test_a_declared_size_over_the_limit_is_413_before_reading():
    req = FakeRequest([b"x" * 5], declared="5")
    msg = refused(body_of, req, 4, status=413)
    assert msg == "request body is 5 bytes; the limit is 4" and req.read == 0


def test_a_body_that_grows_past_the_limit_is_413_at_once():
    req = FakeRequest([b"abc", b"de", b"fgh"], declared="3")  # the header lied
    assert refused(body_of, req, 4, status=413) == "request body exceeds the 4-byte limit" and req.read == 2


def test_a_client_hanging_up_mid_body_is_client_gone():
    with pytest.raises(ClientGone, match=r"^the client disconnected while sending the request body \(3 bytes received\)$"):
        body_of(FakeRequest([b"ab", b"c"], hang_up=True), 100)


def test_parse_body_is_a_json_object_or_one_error():
    assert parse_body(json.dumps({"prompt": "আম"}).encode()) == {"prompt": "আম"}
    assert refused(parse_body, b'{"a": "\xff"}') == "request body is not valid UTF-8 (byte 7)"
    assert refused(parse_body, b'{"a": [1,\n  }') == "request body is not valid JSON: Expecting value at line 2 column 3"
    assert refused(parse_body, b"[1]") == "request body must be a JSON object"
    deep = refused(parse_body, b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}")
    assert deep.startswith("request body: ") and "nested deeper than 64 levels" in deep


def test_the_server_config_defaults():
    c = ServerConfig("m")
    assert (c.model_id, c.max_body_bytes, c.max_tokens_cap, c.max_waiting, c.wait_s) == (
        "m", 1 << 20, 2048, DEFAULT_MAX_WAITING, DEFAULT_WAIT_S)
    assert (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS_CAP, DEFAULT_MAX_TOKENS) == (1 << 20, 2048, 256)


# --------------------------------------------------------------------------- fields
def test_a_misspelt_field_is_refused_with_the_nearest_name():
    msg = refused(check_fields, {"messages": [], "temprature": 1}, CHAT_FIELDS)
    assert msg.startswith("unknown field 'temprature' (did you mean 'temperature'?)")
    assert "prompt" in refused(check_fields, {"prompt": "x"}, CHAT_FIELDS)  # a completion field on chat
    assert "messages" in refused(check_fields, {"messages": []}, COMPLETION_FIELDS)
    check_fields({"prompt": "x", "max_tokens": 3, "repeat_penalty": 1.1, "model": "m", "n": 1}, COMPLETION_FIELDS)


@pytest.mark.parametrize(("key", "noop", "other"), [
    ("n", 1, 2), ("frequency_penalty", 0, 0.5), ("presence_penalty", 0, -1), ("logprobs", False, True),
    ("echo", False, True), ("best_of", 1, 3)])
def test_openai_fields_we_do_not_implement_are_accepted_at_their_no_op_only(key, noop, other):
    check_fields({"messages": [], key: noop}, CHAT_FIELDS)
    check_fields({"messages": [], key: None}, CHAT_FIELDS)
    msg = refused(check_fields, {"messages": [], key: other}, CHAT_FIELDS)
    assert msg == f"{key} = {json.dumps(other)} is not supported: only {key}={json.dumps(noop)}"


@pytest.mark.parametrize("key", ["model", "user"])
def test_labels_are_strings_of_at_most_512_characters(key):
    check_fields({"messages": [], key: "x" * 512}, CHAT_FIELDS)
    check_fields({"messages": [], key: None}, CHAT_FIELDS)
    assert refused(check_fields, {"messages": [], key: "x" * 513}, CHAT_FIELDS) == f"{key} is limited to 512 characters"
    assert refused(check_fields, {"messages": [], key: 5}, CHAT_FIELDS) == f"{key} must be a string"
    assert refused(check_fields, {"messages": [], key: "\ud800"}, CHAT_FIELDS) == f"{key} is not valid UTF-8 (lone surrogate)"


def test_store_is_a_boolean():
    check_fields({"messages": [], "store": False}, CHAT_FIELDS)
    check_fields({"messages": [], "store": None}, CHAT_FIELDS)
    assert refused(check_fields, {"messages": [], "store": "yes"}, CHAT_FIELDS) == "store must be true or false"


def test_metadata_is_at_most_16_string_pairs_of_openais_sizes():
    ok = {f"k{i}": "v" for i in range(16)}
    check_fields({"messages": [], "metadata": ok}, CHAT_FIELDS)
    check_fields({"messages": [], "metadata": {"k" * 64: "v" * 512}}, CHAT_FIELDS)
    shape = "metadata must be an object of at most 16 string values"
    assert refused(check_fields, {"messages": [], "metadata": {**ok, "k16": "v"}}, CHAT_FIELDS) == shape
    assert refused(check_fields, {"messages": [], "metadata": ["k", "v"]}, CHAT_FIELDS) == shape
    assert refused(check_fields, {"messages": [], "metadata": {"k" * 65: "v"}}, CHAT_FIELDS) == \
        "metadata keys are limited to 64 characters"
    assert refused(check_fields, {"messages": [], "metadata": {"কী": "v" * 513}}, CHAT_FIELDS) == \
        'metadata["কী"] is limited to 512 characters'
    assert refused(check_fields, {"messages": [], "metadata": {"k": 1}}, CHAT_FIELDS) == 'metadata["k"] must be a string'


def test_stream_options_are_checked_and_need_stream_true():
    check_fields({"messages": [], "stream": True, "stream_options": {"include_usage": True}}, CHAT_FIELDS)
    check_fields({"messages": [], "stream": True, "stream_options": {"include_usage": None}}, CHAT_FIELDS)
    check_fields({"messages": [], "stream": True, "stream_options": {}}, CHAT_FIELDS)
    assert refused(check_fields, {"messages": [], "stream": True, "stream_options": []}, CHAT_FIELDS) == \
        "stream_options must be an object"
    typo = refused(check_fields, {"messages": [], "stream": True, "stream_options": {"include_usag": True}}, CHAT_FIELDS)
    assert typo.startswith("stream_options: unknown field 'include_usag'") and "include_usage" in typo
    assert refused(check_fields, {"messages": [], "stream": True, "stream_options": {"include_usage": 1}},
                   CHAT_FIELDS) == "stream_options.include_usage must be true or false"
    for stream in (False, None, 1):
        assert refused(check_fields, {"messages": [], "stream": stream, "stream_options": {}}, CHAT_FIELDS) == \
            "stream_options is only allowed with stream: true"


def test_stream_flag():
    assert stream_flag({}) is False and stream_flag({"stream": True}) is True and stream_flag({"stream": False}) is False
    assert refused(stream_flag, {"stream": "true"}) == "stream must be true or false"
    assert refused(stream_flag, {"stream": None}) == "stream must be true or false"


# --------------------------------------------------------------------------- sampling
def test_sampling_defaults_are_the_backends_with_256_tokens_under_the_cap():
    d = SamplingParams()
    p = sampling_from_body({}, 2048)
    assert p == SamplingParams(max_new_tokens=256, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                               repetition_penalty=d.repetition_penalty, seed=None, stop=())
    assert sampling_from_body({}, 100).max_new_tokens == 100  # a lower cap lowers the default


def test_max_tokens_is_within_one_and_the_cap():
    assert sampling_from_body({"max_tokens": 1}, 10).max_new_tokens == 1
    assert sampling_from_body({"max_tokens": 10}, 10).max_new_tokens == 10
    assert refused(sampling_from_body, {"max_tokens": 11}, 10) == "max_tokens must be in [1, 10], got 11"
    assert refused(sampling_from_body, {"max_completion_tokens": 11}, 10) == \
        "max_completion_tokens must be in [1, 10], got 11"
    assert refused(sampling_from_body, {"max_tokens": 0}, 10).startswith("max_tokens = 0")
    assert refused(sampling_from_body, {"max_tokens": "5"}, 10).startswith("max_tokens = '5'")  # strict types
    # OpenAI's newer name wins over the older one when both are given; null is absent
    assert sampling_from_body({"max_completion_tokens": 3, "max_tokens": 9}, 10).max_new_tokens == 3
    assert sampling_from_body({"max_completion_tokens": None, "max_tokens": 9}, 10).max_new_tokens == 9


def test_every_sampling_field_reaches_the_params():
    p = sampling_from_body({"temperature": 0.0, "top_k": 0, "top_p": 0.5, "repetition_penalty": 1.3, "seed": 7,
                            "stop": ["a", "b"]}, 100)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed, p.stop) == (0.0, 0, 0.5, 1.3, 7, ("a", "b"))
    assert sampling_from_body({"repeat_penalty": 1.2}, 100).repetition_penalty == 1.2  # llama.cpp's name
    assert sampling_from_body({"repetition_penalty": 1.1, "repeat_penalty": 1.2}, 100).repetition_penalty == 1.1
    assert sampling_from_body({"repetition_penalty": None, "repeat_penalty": 1.2}, 100).repetition_penalty == 1.2
    assert sampling_from_body({"temperature": None}, 100).temperature == SamplingParams().temperature


@pytest.mark.parametrize(("body", "names"), [
    ({"temperature": "hot"}, "temperature"), ({"top_k": 1.5}, "top_k"), ({"top_p": [1]}, "top_p"),
    ({"repeat_penalty": "x"}, "repeat_penalty"), ({"seed": "s"}, "seed"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p")])
def test_a_bad_sampling_value_is_one_error_naming_its_field(body, names):
    assert refused(sampling_from_body, body, 100).startswith(names)


def test_stop_is_a_string_or_at_most_8_strings_of_at_most_64_characters():
    assert sampling_from_body({"stop": "##"}, 10).stop == ("##",)
    assert sampling_from_body({"stop": None}, 10).stop == ()
    assert sampling_from_body({"stop": ["s"] * 8}, 10).stop == ("s",) * 8
    assert sampling_from_body({"stop": "x" * 64}, 10).stop == ("x" * 64,)
    shape = "stop must be a string or a list of at most 8 strings"
    assert refused(sampling_from_body, {"stop": ["s"] * 9}, 10) == shape
    assert refused(sampling_from_body, {"stop": 5}, 10) == shape
    assert refused(sampling_from_body, {"stop": "x" * 65}, 10) == "stop strings are limited to 64 characters"
    assert refused(sampling_from_body, {"stop": ["a", "x" * 65]}, 10) == "stop strings are limited to 64 characters"
    assert refused(sampling_from_body, {"stop": ["a", 5]}, 10) == "stop must be a string"
    assert refused(sampling_from_body, {"stop": "\udc80"}, 10) == "stop is not valid UTF-8 (lone surrogate)"


def test_params_sampling_params_refuses_are_a_request_error_naming_the_bodys_field():
    # SamplingParams is the one check of a sampling value: whatever it refuses is one 400 naming the field
    # as the body spelt it (max_completion_tokens, repeat_penalty), and the server's cap comes after
    assert refused(sampling_from_body, {"max_completion_tokens": 0}, 10).startswith("max_completion_tokens = 0: ")
    assert refused(sampling_from_body, {"repeat_penalty": 0.0}, 10).startswith("repeat_penalty = 0.0: ")
    assert refused(sampling_from_body, {"repetition_penalty": 11.0}, 10).startswith("repetition_penalty = 11.0: ")
    assert refused(sampling_from_body, {"max_tokens": 1 << 17}, 1 << 20).startswith(f"max_tokens = {1 << 17}: ")
    assert refused(sampling_from_body, {"seed": -1}, 10).startswith("seed = -1: ")
    assert refused(sampling_from_body, {"top_k": True}, 10).startswith("top_k = True: ")  # strict: no bool


# --------------------------------------------------------------------------- messages and prompts
def test_messages_are_role_and_text_content():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "আম"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat_messages({"messages": msgs}) == [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "আম"},
                                                {"role": "assistant", "content": "ab"}]


@pytest.mark.parametrize(("messages", "error"), [
    (None, "messages must be a non-empty list"), ([], "messages must be a non-empty list"),
    ({"role": "user"}, "messages must be a non-empty list"),
    ([{"role": "user", "content": "a"}, "hi"], "messages[1] must be an object"),
    ([{"role": "tool", "content": "a"}], "messages[0].role must be one of system, user, assistant"),
    ([{"content": "a"}], "messages[0].role must be one of system, user, assistant"),
    ([{"role": "user", "content": None}], "messages[0].content must be a string"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     "messages[0].content: only text parts are supported"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content: only text parts are supported"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content must be a string"),
    ([{"role": "user", "content": "\ud800"}], "messages[0].content is not valid UTF-8 (lone surrogate)"),
])
def test_a_bad_message_is_one_error_naming_where(messages, error):
    assert refused(chat_messages, {"messages": messages}) == error


def test_a_misspelt_key_in_a_message_or_a_part_is_refused_by_name():
    msg = refused(chat_messages, {"messages": [{"role": "user", "content": "a", "nmae": "x"}]})
    assert msg.startswith("messages[0]: unknown field 'nmae'")
    part = refused(chat_messages, {"messages": [{"role": "user", "content": "a"}, {
        "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "txt": "b", "text": "c"}]}]})
    assert part.startswith("messages[1].content[1]: unknown field 'txt'")


def test_a_prompt_is_a_string_or_a_list_of_one():
    assert completion_prompt({"prompt": "আম"}) == "আম" and completion_prompt({"prompt": ["x"]}) == "x"
    shape = "prompt must be a string (or a list holding one string)"
    for bad in (None, ["a", "b"], [], [5], 5):
        assert refused(completion_prompt, {"prompt": bad}) == shape
    assert refused(completion_prompt, {"prompt": "\ud800"}) == "prompt is not valid UTF-8 (lone surrogate)"


# --------------------------------------------------------------------------- the adapter field (serving.lora_pairs)
def test_the_adapter_field_names_a_served_pair_or_is_absent():
    from serving.server.http_requests import adapter_from_body

    known = ("bn-chat", "en-qa")
    assert adapter_from_body({}, known) is None and adapter_from_body({"adapter": None}, ()) is None
    assert adapter_from_body({"adapter": "en-qa"}, known) == "en-qa"
    check_fields({"messages": [], "adapter": "en-qa"}, CHAT_FIELDS)  # a known field, not a typo
    none = refused(adapter_from_body, {"adapter": "bn-chat"}, ())
    assert none.startswith("adapter: this server serves no LoRA adapter") and none.endswith("leave the field out")
    assert "(python -m serving BASE.gguf --lora NAME=ADAPTER.gguf serves some)" in none  # how to serve one
    assert refused(adapter_from_body, {"adapter": 5}, known) == \
        "adapter must be one adapter's name (a string), one of: bn-chat, en-qa"
    assert refused(adapter_from_body, {"adapter": "fr"}, known) == 'adapter "fr" is not served here; known: bn-chat, en-qa'
    long = refused(adapter_from_body, {"adapter": "আ" * 600 + "\ud800"}, known)  # shown cut and ASCII-escaped
    escaped = "\\u0986" * 512  # the first 512 characters, each as JSON's ASCII escape
    assert long == f'adapter "{escaped}" is not served here; known: bn-chat, en-qa'
