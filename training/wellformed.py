"""Bengali orthographic well-formedness: the share of Bengali grapheme clusters that a reader could write.

A small model can emit token sequences no Bangla writer would: a vowel sign with no consonant before
it, two vowel signs in a row, a virama dangling after a vowel sign (`বাংলাা্রসী`, `প্রাো`). Bits per
byte does not see this; a reader does at once. This module splits text into orthographic clusters by
a few rules over the Bengali block (U+0980–U+09FF) and counts the ones that break them.

A valid cluster is one of (C consonant, N nukta, H virama, J ZWJ/ZWNJ, M vowel sign, S candrabindu,
anusvara or visarga, V independent vowel):

    C N? (J? H J? C N?)* (M | J? H J?)? S?           a consonant, its conjunct, one vowel sign or a final virama
    V S?                                             an independent vowel and its sign
    [অএ] H য M? S?                                   ya-phala on অ/এ in loanwords: অ্যাপ, এ্যাসিড
    ৎ                                                khanda ta stands alone

M is one vowel sign, or the two-part spellings of ো/ৌ (U+09C7 + U+09BE / U+09D7) that NFC composes.
Everything else in the Bengali block that cannot start a cluster (a vowel sign, nukta, virama, sign
or joiner with no valid base, or an unassigned code point) is invalid. Following Unicode grapheme
segmentation, such stray marks extend the cluster before them, so `লাা্` is one invalid cluster;
with nothing Bengali before them they form an invalid cluster of their own. Digits, currency signs,
avagraha and the like are not letters and not counted; non-Bengali text is ignored.

Torch-free leaf module: it imports only the standard library.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

BENGALI = (0x0980, 0x09FF)
CONSONANTS = "\u0995-\u09a8\u09aa-\u09b0\u09b2\u09b6-\u09b9\u09dc\u09dd\u09df\u09f0\u09f1"
VOWELS = "\u0985-\u098c\u098f\u0990\u0993\u0994\u09e0\u09e1"
VOWEL_SIGNS = "\u09be-\u09c4\u09c7\u09c8\u09cb\u09cc\u09d7\u09e2\u09e3"
SIGNS = "\u0981-\u0983"  # candrabindu, anusvara, visarga
NUKTA, VIRAMA, KHANDA_TA = "\u09bc", "\u09cd", "\u09ce"
JOINERS = "\u200c\u200d"  # ZWNJ, ZWJ: only beside a virama
# Bengali-block characters that are not letters: digits, currency, fractions, avagraha, signs of Vedic use.
NON_LETTERS = "\u0980\u09bd\u09e6-\u09ef\u09f2-\u09fe"
MAX_EXAMPLES = 10  # distinct invalid clusters kept per report

_C, _J = f"[{CONSONANTS}]{NUKTA}?", f"[{JOINERS}]"
_M = f"(?:\u09c7[\u09be\u09d7]|[{VOWEL_SIGNS}])"
_CLUSTER = re.compile(
    f"{_C}(?:{_J}?{VIRAMA}{_J}?{_C})*(?:{_M}|{_J}?{VIRAMA}{_J}?)?[{SIGNS}]?"
    f"|[\u0985\u098f]{VIRAMA}\u09af{_M}?[{SIGNS}]?"
    f"|[{VOWELS}][{SIGNS}]?"
    f"|{KHANDA_TA}"
)
_NON_LETTER = re.compile(f"[{NON_LETTERS}]")


def is_bengali(ch: str) -> bool:
    return BENGALI[0] <= ord(ch) <= BENGALI[1]


@dataclass(frozen=True)
class Cluster:
    text: str
    start: int  # character offset in the text
    valid: bool


def clusters(text: str) -> list[Cluster]:
    """The Bengali letter clusters of `text` in order, each valid or not (see the module docstring)."""
    out: list[Cluster] = []
    i, n = 0, len(text)
    while i < n:
        m = _CLUSTER.match(text, i)
        if m:
            out.append(Cluster(m.group(), i, True))
            i = m.end()
            continue
        ch = text[i]
        stray = is_bengali(ch) and not _NON_LETTER.match(ch)
        # A joiner is stray only where Bengali surrounds it; elsewhere (Persian, emoji) it is not ours.
        if ch in JOINERS:
            stray = (i > 0 and is_bengali(text[i - 1])) or (i + 1 < n and is_bengali(text[i + 1]))
        if not stray:
            i += 1
            continue
        j = i + 1  # the run of marks that no base can take
        while j < n and not _CLUSTER.match(text, j) and (text[j] in JOINERS or
                                                          (is_bengali(text[j]) and not _NON_LETTER.match(text[j]))):
            j += 1
        if out and out[-1].start + len(out[-1].text) == i:  # stray marks extend the cluster before them
            prev = out.pop()
            out.append(Cluster(prev.text + text[i:j], prev.start, False))
        else:
            out.append(Cluster(text[i:j], i, False))
        i = j
    return out


@dataclass
class WellFormed:
    """Well-formedness of some text: `share` of its Bengali clusters that are valid."""

    clusters: int = 0
    valid: int = 0
    invalid: Counter = field(default_factory=Counter)  # invalid cluster text -> count

    @property
    def share(self) -> float:
        """Valid / all Bengali clusters; 1.0 for text without any (nothing to get wrong)."""
        return self.valid / self.clusters if self.clusters else 1.0

    def add(self, text: str) -> WellFormed:
        for c in clusters(text):
            self.clusters += 1
            if c.valid:
                self.valid += 1
            else:
                self.invalid[c.text] += 1
        return self

    def to_dict(self) -> dict:
        return {"share": self.share, "clusters": self.clusters, "invalid": self.clusters - self.valid,
                "examples": [c for c, _ in self.invalid.most_common(MAX_EXAMPLES)]}


def wellformed(texts: str | Iterable[str]) -> WellFormed:
    """Count the Bengali clusters of one text or many, valid and not."""
    wf = WellFormed()
    for t in [texts] if isinstance(texts, str) else texts:
        wf.add(t)
    return wf
