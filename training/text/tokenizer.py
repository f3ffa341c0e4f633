"""Tokenizer: the one SentencePiece wrapper (load/encode/decode/specials), its training, fertility.

The SentencePiece configuration is chosen so llama.cpp's "llama" (SPM) tokenizer reproduces it
exactly: BPE (llama.cpp merges by piece score), byte fallback (no <unk> for unseen characters),
the identity normalization rule and no whitespace folding (llama.cpp normalizes nothing: our
`training.text.normalization.normalize` runs before SentencePiece instead), no dummy prefix, digits split.

Special tokens are control symbols: SentencePiece never produces them from text. `encode(...,
allow_special=True)` splits the text on their literal strings first, exactly as llama.cpp does with
parse_special, so chat prompts render the same everywhere while user text can never inject them.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from training.text.normalization import normalize

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_SPECIALS = (IM_START, IM_END)
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
MAX_SENTENCE_BYTES = 1 << 16

# Passed verbatim to SentencePieceTrainer; exported into GGUF/HF metadata by `export`.
SPM_TRAINER_OPTIONS: dict[str, object] = {
    "model_type": "bpe",
    "byte_fallback": True,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "split_digits": True,
    "allow_whitespace_only_pieces": True,
    "split_by_whitespace": True,
    "character_coverage": 0.9995,
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "pad_id": PAD_ID,
    "unk_piece": UNK,
    "bos_piece": BOS,
    "eos_piece": EOS,
    "pad_piece": PAD,
    "control_symbols": list(CHAT_SPECIALS),
    "max_sentence_length": MAX_SENTENCE_BYTES,
    "hard_vocab_limit": False,
}


class TokenizerError(ValueError):
    pass


SPACE_PIECE = "\u2581"  # SentencePiece's visible space
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback piece's name


def piece_bytes(piece: str, kind: str) -> bytes:
    """The bytes a SentencePiece piece spells: <0xE0> (kind "byte") is the byte E0, a control token
    nothing, U+2581 a space (kinds as `Piece` names them)."""
    if kind == "byte":
        return bytes([int(piece[3:5], 16)])
    if kind == "control":
        return b""
    return piece.replace(SPACE_PIECE, " ").encode("utf-8")


@dataclass(frozen=True)
class Piece:
    id: int
    text: str
    score: float
    kind: str  # "normal" | "unknown" | "control" | "byte" | "unused" | "user_defined"


class ForeignSentencePiece:
    """A SentencePiece model that is not prodip's (an imported base model's own tokenizer.model): no prodip
    specials required, no normalization applied: `encode` gives the ids that model saw for exactly this text."""

    def __init__(self, proto: bytes, where: str = "bytes"):
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with C++ text
            raise TokenizerError(f"not a SentencePiece model ({where}): {e}") from None
        self.bos_id, self.pad_id = self.sp.bos_id(), self.sp.pad_id()  # -1 where the model has none

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)


class Tokenizer:
    """Load with `Tokenizer.load(path)`; `encode` applies `normalize` first, always."""

    def __init__(self, proto: bytes, path: Path | None = None):
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with C++ text
            raise TokenizerError(f"not a SentencePiece model ({path or 'bytes'}): {e}") from None
        self.proto = proto
        self.path = path
        self.sha256 = hashlib.sha256(proto).hexdigest()
        self.special_ids = {p: self.sp.piece_to_id(p) for p in (UNK, BOS, EOS, PAD, *CHAT_SPECIALS)}
        missing = [p for p, i in self.special_ids.items() if self.sp.id_to_piece(i) != p]
        if missing:
            raise TokenizerError(f"tokenizer {path} lacks prodip's special tokens {missing}; retrain it with training.prepare")
        self._piece_bytes: list[bytes] | None = None  # decode_bytes' table, built on first use
        self._strip_space = False
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in CHAT_SPECIALS) + ")")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.model"
        if not p.is_file():
            raise TokenizerError(f"tokenizer not found: {p}")
        return cls(p.read_bytes(), p)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_bytes(self.proto)

    # ids of the special tokens
    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self.special_ids[BOS]

    @property
    def eos_id(self) -> int:
        return self.special_ids[EOS]

    @property
    def pad_id(self) -> int:
        return self.special_ids[PAD]

    @property
    def unk_id(self) -> int:
        return self.special_ids[UNK]

    @property
    def im_start_id(self) -> int:
        return self.special_ids[IM_START]

    @property
    def im_end_id(self) -> int:
        return self.special_ids[IM_END]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, allow_special: bool = False) -> list[int]:
        """Normalize, then tokenize. With allow_special, literal chat specials become their ids."""
        text = normalize(text)
        ids: list[int] = [self.bos_id] if bos else []
        if allow_special:
            for frag in self._special_re.split(text):
                if frag in self.special_ids:
                    ids.append(self.special_ids[frag])
                elif frag:
                    ids.extend(self.sp.encode(frag))
        else:
            ids.extend(self.sp.encode(text))
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode([normalize(t) for t in texts])

    def decode(self, ids: Iterable[int], *, keep_special: bool = False) -> str:
        """Text of `ids`. Control tokens are dropped unless keep_special (then rendered literally)."""
        ids = [int(i) for i in ids]
        if not keep_special:
            return self.sp.decode(ids)
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if self.sp.is_control(i):
                out.append(self.sp.decode(run))
                run = []
                out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of `ids`, control tokens dropped: what `decode` gives, except that byte pieces which
        do not form UTF-8 (a lone <0xE0>) stay bytes; SentencePiece's own decode (even out_type=bytes)
        writes U+FFFD for them. Joined from the pieces (table built once); a dummy-prefix space is stripped
        as decode strips it (prodip trains without one, a loaded model may have it)."""
        if self._piece_bytes is None:
            self._piece_bytes = [self.sp.decode([p.id]).encode("utf-8") if p.kind == "unknown"
                                 else piece_bytes(p.text, p.kind) for p in self.pieces()]
            self._strip_space = bool(self.trainer_spec()["add_dummy_prefix"])
        out = b"".join(self._piece_bytes[int(i)] for i in ids)
        return out[1:] if self._strip_space and out.startswith(b" ") else out

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(i)

    def pieces(self) -> Iterator[Piece]:
        """Every vocabulary entry with its score and kind (what GGUF's token_type records)."""
        sp = self.sp
        for i in range(self.vocab_size):
            if sp.is_unknown(i):
                kind = "unknown"
            elif sp.is_control(i):
                kind = "control"
            elif sp.is_byte(i):
                kind = "byte"
            elif sp.is_unused(i):
                kind = "unused"
            else:
                kind = "normal"
            yield Piece(i, sp.id_to_piece(i), sp.get_score(i), kind)

    def trainer_spec(self) -> dict[str, object]:
        """The training options stored inside the model file (add_dummy_prefix etc.)."""
        from sentencepiece import sentencepiece_model_pb2 as pb

        m = pb.ModelProto()
        m.ParseFromString(self.proto)
        return {
            "model_type": pb.TrainerSpec.ModelType.Name(m.trainer_spec.model_type),
            "byte_fallback": m.trainer_spec.byte_fallback,
            "add_dummy_prefix": m.normalizer_spec.add_dummy_prefix,
            "remove_extra_whitespaces": m.normalizer_spec.remove_extra_whitespaces,
            "normalization_rule_name": m.normalizer_spec.name,
            "split_digits": m.trainer_spec.split_digits,
        }


def train_tokenizer(sentences: Iterable[str], vocab_size: int, *, seed: int = 0, num_threads: int | None = None,
                    **overrides: object) -> Tokenizer:
    """Train prodip's SentencePiece BPE on already-normalized sentences (one per item)."""
    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    opts = {**SPM_TRAINER_OPTIONS, **overrides}
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buf,
        vocab_size=vocab_size,
        num_threads=num_threads or os.cpu_count() or 1,
        shuffle_input_sentence=False,  # we sample deterministically ourselves
        minloglevel=2,
        **opts,
    )
    # The model file records the trainer's thread count (the pieces do not depend on it): pin it,
    # so the file and its sha256 (stamped on every shard) depend only on the data and options.
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(buf.getvalue())
    m.trainer_spec.num_threads = 1
    return Tokenizer(m.SerializeToString())
