"""Vocabulary extension: a base model's SentencePiece tokenizer with pieces appended, and the rows an
imported model's embedding and head grow by.

    extend(base, trained, n)   base's pieces, unchanged and at their ids, then prodip's special tokens
                               the base lacks (<pad>, <|im_start|>, <|im_end|>: control pieces), then up
                               to n normal pieces of `trained` (a BPE trained on the corpus) that the base
                               lacks, in `trained`'s order, scored below every base piece (a BPE merges
                               the base's pairs first)
    is_extension(base, ext)    ext's first pieces are exactly base's (text, kind, score)
    check_carried(base, where) a base whose normalizer llama.cpp and tokenizer.json cannot repeat is refused
    extended_tokenizer(...)    what `training.prepare --extend-tokenizer BASE --add-pieces N` writes
    new_row_sources(...)       for each appended piece, the base ids of the text it spells: its new
                               embedding (and head) row is the mean of the base rows of those ids, so
                               the model starts from what it knew of that text, not from noise
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from sentencepiece import SentencePieceProcessor
from sentencepiece import sentencepiece_model_pb2 as pb

from training.text.normalization import normalize
from training.text.tokenizer import BOS, CHAT_SPECIALS, EOS, PAD, UNK, Tokenizer, piece_bytes, train_tokenizer

NORMAL, CONTROL = pb.ModelProto.SentencePiece.NORMAL, pb.ModelProto.SentencePiece.CONTROL


class ExtendError(ValueError):
    pass


def parse(proto: bytes, where: str) -> pb.ModelProto:
    m = pb.ModelProto()
    try:
        m.ParseFromString(proto)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
        raise ExtendError(f"{where}: not a SentencePiece model ({type(e).__name__})") from None
    if not m.pieces:
        raise ExtendError(f"{where}: not a SentencePiece model (no pieces)")
    return m


def check_carried(m: pb.ModelProto, where: str) -> None:
    """A base whose own normalizer rewrites text (SentencePiece's default nmt_nfkc: NFKC, ZWJ/ZWNJ dropped) or
    folds whitespace is refused: llama.cpp's SentencePiece tokenizer and the exported tokenizer.json apply
    neither, so its exports would tokenize otherwise than training. Llama's own (identity, a dummy prefix) is fine."""
    spec = m.normalizer_spec
    if (spec.name or "identity") != "identity" or spec.remove_extra_whitespaces:
        what = f"normalization rule {spec.name!r}" if (spec.name or "identity") != "identity" else "whitespace folding"
        raise ExtendError(f"{where}: its {what} (normalizer_spec) cannot be carried to GGUF/llama.cpp and the HF "
                          "tokenizer.json, which normalize nothing; prodip extends identity-normalized tokenizers only")


def extend(base: bytes, trained: bytes, add_pieces: int, where: str = "base tokenizer") -> tuple[bytes, int]:
    """(the extended model's bytes, how many normal pieces were appended)."""
    m, t = parse(base, where), parse(trained, "trained pieces")
    check_carried(m, where)
    have = {p.piece for p in m.pieces}
    lacking = [s for s in (UNK, BOS, EOS) if s not in have]
    if lacking:
        raise ExtendError(f"{where} lacks {lacking}: prodip keeps <unk> <s> </s> at the base's own ids")
    low = min((p.score for p in m.pieces if p.type == NORMAL), default=0.0)
    for s in (PAD, *CHAT_SPECIALS):
        if s not in have:
            m.pieces.add(piece=s, score=0.0, type=CONTROL)
            have.add(s)
    added = 0
    for p in t.pieces:
        if added == add_pieces:
            break
        if p.type == NORMAL and p.piece not in have:
            added += 1
            m.pieces.add(piece=p.piece, score=low - added, type=NORMAL)
            have.add(p.piece)
    m.trainer_spec.vocab_size = len(m.pieces)
    return m.SerializeToString(), added


def is_extension(base: bytes, ext: bytes) -> bool:
    """Whether `ext` keeps every piece of `base` at its id (same text, kind and score) and adds some."""
    try:
        b, e = parse(base, "base"), parse(ext, "extended")
    except ExtendError:
        return False
    if len(e.pieces) <= len(b.pieces):
        return False
    return all((p.piece, p.type, p.score) == (q.piece, q.type, q.score) for p, q in zip(b.pieces, e.pieces))


def new_row_sources(base: bytes, ext: Tokenizer, base_vocab: int) -> list[list[int]]:
    """For each id >= base_vocab of `ext`: the base ids of the text its piece spells ([] for a control
    piece: its row is the mean of all base rows)."""
    sp = SentencePieceProcessor()
    sp.LoadFromSerializedProto(base)
    # a base with a dummy prefix (stock Llama) puts the "▁" of a word-initial piece there itself: encoding
    # "▁foo"'s text " foo" as is would spell "▁▁foo". A word-internal piece then starts as "▁"+text (close).
    dummy = parse(base, "base").normalizer_spec.add_dummy_prefix
    out = []
    for i in range(base_vocab, ext.vocab_size):
        kind = "control" if ext.sp.is_control(i) else "normal"
        text = piece_bytes(ext.id_to_piece(i), kind).decode("utf-8", errors="replace")
        if dummy and text.startswith(" "):
            text = text[1:]
        out.append(sp.encode(text) if text else [])
    return out


def read_base(path: Path) -> bytes:
    """--extend-tokenizer's file: a SentencePiece model (a folder means its tokenizer.model)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.model"
    if not p.is_file():
        raise ExtendError(f"--extend-tokenizer: not found: {p}")
    base = p.read_bytes()
    check_carried(parse(base, f"--extend-tokenizer {p}"), f"--extend-tokenizer {p}")
    return base


def extended_tokenizer(base: bytes, sentences: list[str], add_pieces: int, *, seed: int = 0,
                       num_threads: int | None = None, where: str = "--extend-tokenizer") -> tuple[Tokenizer, int]:
    """Train a BPE on `sentences` (prodip's options) of the base's size plus add_pieces, so that enough of its
    pieces are new; append up to add_pieces of them (and prodip's special tokens) to the base."""
    size = len(parse(base, where).pieces) + add_pieces
    trained = train_tokenizer(sentences, size, seed=seed, num_threads=num_threads)
    ext, added = extend(base, trained.proto, add_pieces, where)
    return Tokenizer(ext), added


@dataclass(frozen=True)
class BaseTokenizer:
    """What training.text.fertility reads of a tokenizer, for a base that prodip's Tokenizer may refuse (a stock
    Llama tokenizer has no <pad>): the fertility before extension is measured on the same normalized text."""

    proto: bytes

    @property
    def sp(self) -> SentencePieceProcessor:
        return SentencePieceProcessor(model_proto=self.proto)

    @property
    def vocab_size(self) -> int:
        return len(parse(self.proto, "base").pieces)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.proto).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode([normalize(t) for t in texts])
