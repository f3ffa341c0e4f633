"""A data folder (or file) at a store URL, pulled once into a local cache with a checksum check.

    python training/train.py --data s3://BUCKET/data/bn32k ...          (a folder written by training.prepare)
    python training/sft.py   --data s3://BUCKET/chat/conversations ...  (JSONL files, or one file)

The copy lives in ~/.cache/prodip/data/<16 hex of sha256(URL)>: every file's size, and its MD5 where
the store's ETag is one (single-part uploads), is checked, and a record of the listing (PULLED) is
written last. The next run reuses the copy while the listing is unchanged and every cached file has
its size. Processes pulling the same URL at once (torchrun's ranks on one machine, two runs) take
turns on a lock file, so the second finds the first's copy instead of racing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from training.store.remote_run import (
    CACHE_ROOT,
    Remote,
    RemoteError,
    Unreachable,
    _url_key,
    cache_dir,
    is_url,
    pull_run,
)

PULLED = ".prodip_pulled.json"  # a pulled data folder's record: every object's size and ETag, written last


def data_cache_dir(url: str) -> Path:
    """Where a --data URL is pulled: ~/.cache/prodip/data/<sha256 of the URL, 16 hex>."""
    return CACHE_ROOT.expanduser().parent / "data" / _url_key(url)


def _md5_ok(path: Path, etag: str) -> bool:
    """The file against the store's ETag, when that is an MD5 (a single-part upload); else only its size."""
    etag = etag.strip('"')
    if not etag or "-" in etag or len(etag) != 32:
        return True
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest() == etag


@contextlib.contextmanager
def locked(dest: Path) -> Iterator[None]:
    """One puller of `dest` at a time on this machine (an flock, released when the process dies)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _listing(r: Remote) -> dict[str, dict]:
    """{local name: {size, etag, key}} of the files under the URL (key: the object's path under it); a URL
    naming one object lists that object under its own name, with key "" (the URL itself)."""
    found = r._call(r.fs.find, r.root, detail=True)
    files = {k: v for k, v in found.items() if v.get("type") == "file"}
    if set(files) == {r.root}:  # the URL is a file, not a folder
        v = files[r.root]
        return {r.root.rsplit("/", 1)[-1]: {"size": int(v.get("size") or 0), "etag": str(v.get("ETag", "")), "key": ""}}
    return {k[len(r.root) + 1:]: {"size": int(v.get("size") or 0), "etag": str(v.get("ETag", "")),
                                  "key": k[len(r.root) + 1:]} for k, v in files.items() if k.startswith(r.root + "/")}


def pull_data(url: str, say: Callable[[str], None], flag: str = "--data") -> Path:
    """The folder (or file) at `url` as a local folder: pulled once into data_cache_dir(url), every file's
    size and MD5 (the store's ETag) checked, and pulled again only when the store's listing changes or
    a cached file lost its size. A store that does not answer is fine when it was pulled before (a
    warning); else RemoteError."""
    r = Remote(url, flag)
    dest = data_cache_dir(r.url)
    with locked(dest):
        return _pull(r, dest, say, flag)


def _pull(r: Remote, dest: Path, say: Callable[[str], None], flag: str) -> Path:
    record = dest / PULLED
    try:
        r.check()
        listing = _listing(r)
    except Unreachable as e:
        if record.is_file():
            say(f"warning: {e}; using the copy pulled before, {dest}")
            return dest
        raise RemoteError(f"{flag} {r.url}: {e}, and it was never pulled to this machine") from None
    if not listing:
        raise RemoteError(f"{flag} {r.url}: holds no files (expected a folder written by `python -m training.prepare`"
                          " or files of conversations)")
    if record.is_file() and json.loads(record.read_text()) == listing and \
            all((dest / k).is_file() and (dest / k).stat().st_size == v["size"] for k, v in listing.items()):
        return dest
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, v in listing.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            r.get(v["key"], tmp / rel)
            if (tmp / rel).stat().st_size != v["size"] or not _md5_ok(tmp / rel, v["etag"]):
                raise RemoteError(f"{flag} {r.url}/{rel}: the downloaded file does not match the store's size and "
                                  "checksum; run the same command again")
        (tmp / PULLED).write_text(json.dumps(listing))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"pulled {flag} {r.url} ({len(listing)} files) into {dest}")
    return dest


def local_init(init: str, say: Callable[[str], None], flag: str = "--init") -> str:
    """--init as a local path: a run at a store URL (python training/train.py --out s3://...) is pulled,
    newest committed checkpoint only, into its default cache (training.store.remote_run.pull_run), one process at a
    time (torchrun's ranks take turns; the second finds the copy); a local path is kept as given."""
    if not is_url(init):
        return init
    with locked(cache_dir(Remote(init, flag).url)):
        return str(pull_run(init, None, say, flag=flag))
