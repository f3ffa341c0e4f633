"""The one chat template (ChatML), its Jinja text for every export, and assistant-token masks.

    <|im_start|>system\n{content}<|im_end|>\n      (optional)
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}<|im_end|>\n
    ...
    <|im_start|>assistant\n                          (generation prompt)

The sequence starts with <s>, written by the template itself (`{{ bos_token }}`, as Llama-2 and
Mistral templates do): llama-cpp-python's Jinja2ChatFormatter and transformers' apply_chat_template
tokenize the rendered text without adding BOS, and llama.cpp's server strips a leading BOS it would
add twice. So the rendered text and its tokens are identical in llama-cpp-python, transformers and
here (`render()` text, `encode()` ids); ollama's Go template has no BOS because ollama adds it.
`CHAT_TEMPLATE` goes into tokenizer_config.json and GGUF's tokenizer.chat_template; `OLLAMA_TEMPLATE`
into the Modelfile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from training.text.normalization import normalize
from training.text.tokenizer import BOS, IM_END, IM_START, Tokenizer

ROLES = ("system", "user", "assistant")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The same template in ollama's Go-template syntax.
OLLAMA_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n"
)

STOP_STRINGS = (IM_END, IM_START)


class ChatError(ValueError):
    pass


def validate(messages: Sequence[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatError(f"message {i} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatError(f"message {i}: role {m['role']!r} is not one of {ROLES}")
        if not isinstance(m["content"], str):
            raise ChatError(f"message {i}: content must be a string")
        out.append({"role": m["role"], "content": normalize(m["content"])})
    return out


def render(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text (from <s>), byte-identical to CHAT_TEMPLATE rendered by Jinja with bos_token="<s>"."""
    parts = [BOS] + [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in validate(messages)]
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


@dataclass
class EncodedChat:
    ids: list[int]
    assistant_mask: list[int]  # 1 where the token is an assistant content token or its <|im_end|>


def encode(tok: Tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> EncodedChat:
    """Token ids of the rendered conversation, starting with <s>, plus the assistant-token mask.

    Each part is tokenized on its own. That equals tokenizing the whole rendered text, because the
    special tokens split the text (as in llama.cpp) and '\\n' is never merged into a piece.
    User content cannot inject special tokens: it is encoded with allow_special=False.
    """
    ids, mask = [tok.bos_id], [0]
    for m in validate(messages):
        head = [tok.im_start_id] + tok.encode(m["role"] + "\n")
        body = tok.encode(m["content"]) + [tok.im_end_id]
        tail = tok.encode("\n")
        is_asst = 1 if m["role"] == "assistant" else 0
        ids += head + body + tail
        mask += [0] * len(head) + [is_asst] * len(body) + [0] * len(tail)
    if add_generation_prompt:
        head = [tok.im_start_id] + tok.encode("assistant\n")
        ids += head
        mask += [0] * len(head)
    return EncodedChat(ids, mask)


def truncate_history(tok: Tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[dict], int]:
    """Drop the oldest non-system turns until the prompt fits `max_tokens`; returns (kept, dropped).

    `encode` tokenizes each message on its own, so the prompt's length is <s> + the generation prompt +
    every message's own length; as dropped turns are the oldest, what is kept is the system messages and
    the longest run of newest turns that fits. So the turns are measured newest first, and only until
    the budget is spent: the tokenizer sees the kept messages and one more, never the dropped history
    (re-encoding the whole conversation per dropped turn took 41 s for 1,001 one-letter messages). The
    result is the one-by-one definition's, error included: the last message is never dropped."""
    msgs = validate(messages)

    def own(m: dict) -> int:  # the message's tokens, less the <s> that encode() starts with
        return len(encode(tok, [m], add_generation_prompt=False).ids) - 1

    used = len(encode(tok, []).ids) + sum(own(m) for m in msgs if m["role"] == "system")
    turns = [i for i, m in enumerate(msgs) if m["role"] != "system"]
    keep = 0  # how many of the newest turns fit
    while keep < len(turns) and used + (n := own(msgs[turns[-1 - keep]])) <= max_tokens:
        used += n
        keep += 1
    must_keep = 1 if turns and turns[-1] == len(msgs) - 1 else 0  # the message being answered stays
    if used > max_tokens or keep < must_keep:
        raise ChatError(f"the message alone is longer than the context ({max_tokens} tokens); shorten it")
    gone = set(turns[:len(turns) - keep])
    return [m for i, m in enumerate(msgs) if i not in gone], len(gone)
