"""tokenizer.json: our SentencePiece tokenizer and `training.text.normalization.normalize` as one Hugging Face
`tokenizers` pipeline, so `AutoTokenizer.from_pretrained(RUN/export/hf)` (and vLLM, TGI, lm_eval...)
gives exactly training's ids on raw text, with no prodip code in the loop.

Each stage mirrors one of ours:
- normalizer: training.text.normalization.normalize step by step: drop U+FEFF, CRLF and lone CR -> LF, then NFC
  (which maps both spellings of ড় ঢ় য় to base + nukta and keeps ZWJ/ZWNJ and whitespace runs).
  One patch: `tokenizers`' NFC tables predate Unicode 10, so they take the Bengali sandhi mark
  U+09FE (Unicode 10, combining class 230) for a starter and leave it before a following nukta or
  virama, which NFC puts first; two Replace steps after NFC do that reordering. What stays different
  is text no one writes: U+09FE repeated or beside other above-marks (e.g. U+0301) before a
  nukta/virama, and combining marks of other scripts added after Unicode 9.
- spaces: SentencePiece's whitespace escape " " -> "▁" (U+2581), no dummy prefix (a tokenizer extended
  from a Llama base keeps its own: a "▁" prepended, stripped again when decoding), as the normalizer's
  last step; the pre-tokenizer splits nothing (a Split on a string no text holds). Not `Metaspace`:
  ONNX Runtime GenAI's tokenizer (onnxruntime-extensions) reads a Metaspace model as Llama's and
  pre-splits it with Llama's regex, whose letter runs (\\p{L}+) end at every Bangla vowel sign and
  virama (marks, \\p{M}): আমাদের became আম|াদ|ের. With the no-op Split it merges whole words, as we do.
- model: BPE over our vocabulary with byte fallback. SentencePiece's BPE merges the adjacent pair
  whose merged piece scores highest; `tokenizers` merges the pair of lowest rank, so the merges are
  every (left, right) split of a normal piece into two pieces, ranked by the merged piece's score.
  Control, unknown and byte pieces are never merge results: SentencePiece never makes them from text.
- specials: <unk> <s> </s> <pad> and the chat markers are added tokens (split out before
  normalization), i.e. training.text.tokenizer's `allow_special=True`; the post-processor prepends <s>.
- decoder: "▁" -> " ", byte pieces -> UTF-8, as SentencePiece decodes.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from training.text.normalization import BOM, NUKTA
from training.text.tokenizer import BOS, CHAT_SPECIALS, EOS, PAD, UNK, Tokenizer
from training.text.tokenizer import SPACE_PIECE as SPACE  # SentencePiece's escaped space (U+2581)

TOKENIZER_JSON = "tokenizer.json"
SANDHI, VIRAMA = "\u09fe", "\u09cd"  # BENGALI SANDHI MARK (see the normalizer), BENGALI SIGN VIRAMA
NO_SPLIT = "\uffff"  # a Unicode noncharacter: never in text, so splitting on it splits nothing


def normalizer(escape_spaces: bool = False, dummy_prefix: bool = False) -> normalizers.Normalizer:
    """training.text.normalization.normalize as `tokenizers` steps, in the same order (then, with `escape_spaces`,
    SentencePiece's " " -> "▁", and with `dummy_prefix` its leading "▁")."""
    return normalizers.Sequence([
        normalizers.Replace(BOM, ""),
        normalizers.Replace("\r\n", "\n"),
        normalizers.Replace("\r", "\n"),
        normalizers.NFC(),
        *(normalizers.Replace(SANDHI + mark, mark + SANDHI) for mark in (NUKTA, VIRAMA)),
        *([normalizers.Replace(" ", SPACE)] if escape_spaces else []),
        *([normalizers.Prepend(SPACE)] if dummy_prefix else []),
    ])


def bpe_merges(tok: Tokenizer) -> list[tuple[str, str]]:
    """Every split of a normal piece into two vocabulary pieces, highest merged score first (ties:
    the vocabulary order), the order in which SentencePiece's BPE would apply them."""
    pieces = list(tok.pieces())
    vocab = {p.text: p.id for p in pieces}
    ranked = []
    for p in pieces:
        if p.kind != "normal":
            continue
        for cut in range(1, len(p.text)):
            left, right = p.text[:cut], p.text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-p.score, p.id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build(tok: Tokenizer) -> HFTokenizer:
    """The `tokenizers` pipeline for `tok` (see the module docstring)."""
    vocab = {p.text: p.id for p in tok.pieces()}
    hf = HFTokenizer(BPE(vocab=vocab, merges=bpe_merges(tok), unk_token=UNK, fuse_unk=True, byte_fallback=True,
                         dropout=None))
    # a tokenizer extended from a Llama base (training.text.vocab_extend) keeps its dummy prefix: SentencePiece
    # prepends "▁" to each text between special tokens, and decoding drops it again
    dummy = bool(tok.trainer_spec()["add_dummy_prefix"])
    hf.normalizer = normalizer(escape_spaces=True, dummy_prefix=dummy)
    hf.pre_tokenizer = pre_tokenizers.Split(NO_SPLIT, behavior="isolated")
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                    *([decoders.Strip(" ", 1, 0)] if dummy else [])])
    hf.add_special_tokens([AddedToken(s, normalized=False, special=True)
                           for s in (UNK, BOS, EOS, PAD, *CHAT_SPECIALS)])
    hf.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, tok.bos_id)])
    return hf


def write_tokenizer_json(tok: Tokenizer, path: Path) -> Path:
    """Write tokenizer.json for `tok` to `path` (via a temporary file: a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    build(tok).save(str(tmp), pretty=False)
    tmp.replace(path)
    return path
