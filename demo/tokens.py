"""Tokens made visible: the text each token stands for, and characters per token beside the
byte-level bound — the reference report's trap (a byte-level tokenizer gives Bangla ~1.4
characters/token; plain UTF-8 bytes give 1/3, since a Bangla letter is three bytes).

Works through any serving Backend (`tokenize` / `detokenize`), so a foreign GGUF shows its own
tokenizer. Gradio-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving import Backend
from serving.text_stream import bytes_decoder
from training.text.normalization import normalize
from training.text.wellformed import byte_marker, decode_utf8

MAX_TOKENIZE_CHARS = 4000  # the tab's input cap (as the chat's): decoding every prefix is quadratic
N_COLOURS = 6  # token spans cycle through this many colours
REFERENCE_BYTE_BPE_BN = 1.4  # Bangla chars/token of the reference report's byte-level BPE


@dataclass(frozen=True)
class Span:
    text: str  # what these tokens decode to
    ids: tuple[int, ...]  # one token, or a few byte-fallback tokens that make one character


def spans(decode: Callable[[Sequence[int]], bytes], ids: Sequence[int]) -> list[Span]:
    """Split `ids` into spans, each the text its tokens add to the decoded prefix (`decode`: ids -> raw
    bytes, serving.text_stream.bytes_decoder). Byte-fallback tokens that spell one multi-byte character
    together form one span; bytes that never become UTF-8 show as their piece names (<0xE0>), never U+FFFD."""
    out: list[Span] = []
    done = ""  # decoded text of the tokens already in spans
    start = 0
    for i in range(len(ids)):
        u = decode_utf8(decode(list(ids[:i + 1])), final=i + 1 == len(ids), mark=byte_marker)
        if u.pending:
            continue  # the rest of a character is in the next tokens
        text = u.text
        piece = text[len(done):] if text.startswith(done) else text  # decoders may trim a leading space
        out.append(Span(piece, tuple(ids[start:i + 1])))
        done, start = text, i + 1
    return out


@dataclass
class TokenView:
    spans: list[Span]
    chars: int  # characters of the normalized text
    utf8_bytes: int  # = tokens of a byte-level tokenizer without merges

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.spans)

    @property
    def chars_per_token(self) -> float:
        return self.chars / self.tokens if self.tokens else 0.0

    @property
    def chars_per_byte(self) -> float:
        return self.chars / self.utf8_bytes if self.utf8_bytes else 0.0

    def highlighted(self) -> list[tuple[str, str]]:
        """(text, colour label) pairs for gr.HighlightedText: neighbouring tokens differ in colour."""
        return [(s.text, str(i % N_COLOURS)) for i, s in enumerate(self.spans)]

    def table(self, tokenizer: str) -> str:
        return "\n".join([
            "| tokenizer | tokens | chars/token |", "|---|---:|---:|",
            f"| {tokenizer} | {self.tokens} | {self.chars_per_token:.2f} |",
            f"| byte-level, no merges (UTF-8 bytes) | {self.utf8_bytes} | {self.chars_per_byte:.2f} |",
            f"| byte-level BPE of the reference report (Bangla) | — | ~{REFERENCE_BYTE_BPE_BN} |",
            "", f"{self.chars} characters (after normalization). More characters per token = longer text "
            "in the same context and fewer steps per sentence."])


def token_view(backend: Backend, text: str) -> TokenView:
    text = normalize(text)
    ids = backend.tokenize(text, bos=False)
    return TokenView(spans(bytes_decoder(backend), ids), len(text), len(text.encode("utf-8")))
