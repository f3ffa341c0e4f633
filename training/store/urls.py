"""Store URLs: the one type of `s3://BUCKET/PREFIX/RUN` (and gs://, az://, ...) every command takes, and
the schema of the commit markers found at them (training.store.remote_run reads and writes both).

A URL is parsed once, at the boundary: a scheme of training.runfiles.schema.URL_STORES, a bucket, and key
segments none of which is empty, `.` or `..` (`s3:///run` is not bucket `run`; `s3://B/runs/..` is
not the bucket's root), no credentials, port, query or fragment. A trailing `/` is the same place.
Commands that read and write local paths only refuse a URL by name (`local_path`), instead of
letting pathlib fold `s3://B/x` into a local folder `s3:/B/x`.

A leaf module: pydantic, training.runfiles.schema and the standard library (no fsspec, no torch).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from training.runfiles.schema import URL_SCHEME, URL_STORES, first_problem

# schemes that name the same store (gcsfs registers gs and gcs; adlfs az and abfs): one place, two spellings
SAME_STORE = {"gcs": "gs", "abfs": "az"}
REFUSED_CHARS = {"?": "a query", "#": "a fragment", "\\": "a backslash"}


class RemoteError(ValueError):
    """Bad input about a URL (scheme, bucket, segments, credentials, library, a store's refusal): one
    `error:` line naming the URL and the cause, nothing written."""


@dataclass(frozen=True)
class StoreURL:
    scheme: str  # as typed (gs or gcs)
    bucket: str
    key: str  # the segments after the bucket, "/"-joined; "" for the bucket itself

    @property
    def root(self) -> str:
        """fsspec's path: BUCKET/KEY."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.root}"

    @property
    def place(self) -> tuple[str, ...]:
        """The store, bucket and segments: equal for two spellings of one place (gs:// and gcs://, a trailing /)."""
        return (SAME_STORE.get(self.scheme, self.scheme), self.bucket, *(self.key.split("/") if self.key else ()))


def is_url(text: Any) -> bool:
    return bool(URL_SCHEME.match(str(text)))


def parse_url(text: str, flag: str = "--out") -> StoreURL:
    """`text` as a StoreURL; RemoteError naming `flag`, the URL and what is wrong with it."""
    scheme, _, rest = str(text).partition("://")
    if scheme not in URL_STORES:
        raise RemoteError(f"{flag} {text}: unknown URL scheme {scheme}:// (supported: "
                          f"{', '.join(s + '://' for s in URL_STORES)}; or give a local path)")
    segments = rest.rstrip("/").split("/")
    bucket = segments[0]
    if "@" in bucket or ":" in bucket:  # never echoed: the text may hold a secret
        raise RemoteError(f"{flag} {scheme}://...: credentials or a port in the URL are refused; set the standard "
                          "AWS variables (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) instead")
    if not bucket:
        raise RemoteError(f"{flag} {text}: no bucket; expected {scheme}://BUCKET/PREFIX/RUN")
    for ch, what in REFUSED_CHARS.items():
        if ch in rest:
            raise RemoteError(f"{flag} {text}: {what} ({ch!r}) is not part of a store location; "
                              f"expected {scheme}://BUCKET/PREFIX/RUN")
    for seg in segments:
        if seg in ("", ".", ".."):
            shown = "an empty segment (//)" if seg == "" else f"a {seg!r} segment"
            raise RemoteError(f"{flag} {text}: {shown}: a store has no folders to resolve it against; "
                              f"spell the location out ({scheme}://BUCKET/PREFIX/RUN)")
        if any(ord(c) < 0x20 or c == "\x7f" for c in seg):
            raise RemoteError(f"{flag} {text!r}: a control character in the URL")
    return StoreURL(scheme, bucket, "/".join(segments[1:]))


def local_path(text: str) -> Path:
    """An argparse `type=` for a command that reads or writes local paths only: a store URL refused by
    name (argparse adds the flag), not folded by pathlib into a local folder `s3:`."""
    m = URL_SCHEME.match(text)
    if m:
        raise argparse.ArgumentTypeError(f"{m.group(0)} is a store URL; this command takes a local path only "
                                         f"(got {text!r})")
    return Path(text)


def local_text(text: str) -> str:
    """local_path for a value that stays a string (prepare's --input, which also takes hf:NAME)."""
    local_path(text)
    return text


# ---------------------------------------------------------------------------------------- commit markers
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class FileDigest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    size: Annotated[StrictInt, Field(ge=0)]
    sha256: Sha256


class CommitMarker(BaseModel):
    """URL/checkpoints/step_N.commit.json and URL/export.commit.json (training.store.remote_run.Remote.commit)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    prodip_commit: Literal[1]
    step: Annotated[StrictInt, Field(ge=0)] | None = None
    files: Annotated[dict[str, FileDigest], Field(min_length=1)]


def _relative_name(name: str) -> str | None:
    """Why `name` (a file a marker names) would leave its folder, or None: it is joined to local paths."""
    if not name or name.startswith("/") or "\\" in name:
        return "not a relative path"
    if any(seg in ("", ".", "..") for seg in name.split("/")):
        return "an empty, '.' or '..' segment"
    return None


def check_marker(obj: Any, where: str) -> dict:
    """A commit marker's JSON value checked against CommitMarker (and every file name relative, inside its
    folder): the plain dict; RemoteError naming `where` and the first problem otherwise."""
    try:
        m = CommitMarker.model_validate(obj)
    except ValidationError as e:
        raise RemoteError(f"{where}: not a commit marker of this prodip ({first_problem(e)})") from None
    for name in m.files:
        why = _relative_name(name)
        if why:
            raise RemoteError(f"{where}: not a commit marker of this prodip (file {name!r}: {why})")
    return m.model_dump(exclude_none=True)
