"""A run folder in object storage: the URL, the fsspec calls (s3fs for s3://), the commit markers.

    URL/.prodip_run  run.json  log.jsonl  gates.json  tokenizer.model  curves.png ...   (the run files)
    URL/checkpoints/step_0000100/{model.safetensors, optim.safetensors, state.json, ...}
    URL/checkpoints/step_0000100.commit.json   written last: {"prodip_commit": 1, "step", "files": {name: {size, sha256}}}

Object stores have no atomic rename, so a checkpoint is visible only through its commit marker,
uploaded after every file of it: `committed()` lists the checkpoints whose marker names files of
exactly those sizes, `partial()` the step folders without one (an upload cut short), and a download
checks every sha256 against the marker. Removal deletes the marker first.

The endpoint and the credentials are the standard AWS ones (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3,
AWS_ACCESS_KEY_ID..., ~/.aws): botocore reads them; this module never prints, logs or stores a
credential. fsspec and s3fs are imported here, lazily (`pip install 'prodip[remote]'`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from training import layout
from training.files import sha256_file
from training.schema import URL_SCHEME, URL_STORES

COMMIT_SUFFIX = ".commit.json"
COMMIT_FORMAT = ("prodip_commit", 1)
# what a run folder holds besides its checkpoints, mirrored in this order (the marker first: "ours")
RUN_FILES = (layout.RUN_MARKER, layout.RUN_CONFIG, layout.TOKENIZER, layout.GATES, layout.LOG, layout.CURVES,
             layout.NONFINITE, layout.EARLY_STOP)
CACHE_ROOT = Path("~/.cache/prodip/runs")
# botocore's own retries are few and short: the mirror retries with its own back-off, off the training thread
CLIENT_CONFIG = {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 10, "read_timeout": 120}
# exceptions (by class name, so nothing is imported to classify them) that mean "the store is not reachable"
UNREACHABLE = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                         "ClientConnectorError", "ServerDisconnectedError", "ConnectionError", "TimeoutError",
                         "ConnectionRefusedError", "ConnectionResetError", "FSTimeoutError", "ClientOSError"})


class RemoteError(ValueError):
    """Bad input about a URL (scheme, bucket, credentials, library): one `error:` line, nothing written."""


class Unreachable(OSError):
    """The store did not answer (network, server down): the mirror retries; nothing is wrong with the input."""


def is_url(text: str | os.PathLike) -> bool:
    return bool(URL_SCHEME.match(str(text)))


def split_url(url: str, flag: str = "--out") -> tuple[str, str]:
    """(scheme, "bucket/prefix/run") of a store URL; RemoteError naming `flag` otherwise."""
    scheme, _, rest = url.partition("://")
    if scheme not in URL_STORES:
        raise RemoteError(f"{flag} {url}: unknown URL scheme {scheme}:// (supported: "
                          f"{', '.join(s + '://' for s in URL_STORES)}; or give a local path)")
    root = rest.strip("/")
    bucket = root.split("/")[0]
    if "@" in bucket or ":" in bucket:
        raise RemoteError(f"{flag} {scheme}://...: credentials or a port in the URL are refused; set the standard "
                          "AWS variables (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) instead")
    if not bucket:
        raise RemoteError(f"{flag} {url}: no bucket; expected {scheme}://BUCKET/PREFIX/RUN")
    return scheme, root


def _url_key(url: str) -> str:
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def cache_dir(url: str) -> Path:
    """The default local cache of a run at `url`: ~/.cache/prodip/runs/<sha256 of the URL, 16 hex>."""
    return CACHE_ROOT.expanduser() / _url_key(url)


def file_digest(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def _is_unreachable(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if {c.__name__ for c in type(seen).__mro__} & UNREACHABLE:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _filesystem(scheme: str, url: str, flag: str) -> Any:
    """The fsspec file system of `scheme`, its library imported here (a clear error when it is missing)."""
    package = URL_STORES[scheme]
    try:
        __import__(package)
        import fsspec
    except ImportError:
        raise RemoteError(f"{flag} {url}: needs the {package} package, which is not installed "
                          f"(pip install 'prodip[remote]')") from None
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kw: dict[str, Any] = {"config_kwargs": CLIENT_CONFIG, "skip_instance_cache": True}
        if endpoint:
            kw["client_kwargs"] = {"endpoint_url": endpoint}
        return fsspec.filesystem("s3", **kw)
    return fsspec.filesystem(scheme, skip_instance_cache=True)


class Remote:
    """One run folder at a store URL (rank 0's)."""

    def __init__(self, url: str, flag: str = "--out"):
        self.flag = flag
        self.scheme, self.root = split_url(url, flag)
        self.url = f"{self.scheme}://{self.root}"
        self.fs = _filesystem(self.scheme, self.url, flag)

    def _call(self, fn: Any, *a: Any, **k: Any) -> Any:
        """An fsspec call; the store's failures as Unreachable (retry later) or RemoteError (bad input)."""
        try:
            return fn(*a, **k)
        except FileNotFoundError:
            raise
        except Exception as e:
            if _is_unreachable(e):
                raise Unreachable(f"{self.url} is unreachable ({type(e).__name__})") from None
            names = {c.__name__ for c in type(e).__mro__}
            if names & {"NoCredentialsError", "PartialCredentialsError"}:
                raise RemoteError(f"{self.flag} {self.url}: no credentials for the store; set AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / ~/.aws/credentials)") from None
            if isinstance(e, PermissionError):
                raise RemoteError(f"{self.flag} {self.url}: access denied by the store (check the credentials "
                                  "and the bucket's policy)") from None
            raise

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    # --------------------------------------------------------------------------------- checks
    def check(self) -> None:
        """The bucket exists and the credentials work: RemoteError if not, Unreachable when the store is down."""
        bucket = self.root.split("/")[0]
        try:
            self._call(self.fs.info, bucket)  # one HEAD request, however large the bucket
        except FileNotFoundError:
            raise RemoteError(f"{self.flag} {self.url}: bucket {bucket!r} does not exist (create it first)") from None

    def names(self, rel: str = "") -> list[str]:
        """Names directly under URL/rel ([] when nothing is there)."""
        try:
            found = self._call(self.fs.ls, self.path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)

    def sizes(self, rel: str) -> dict[str, int]:
        try:
            found = self._call(self.fs.ls, self.path(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in found
                if e.get("type") == "file"}

    def read_json(self, rel: str, what: str) -> dict | None:
        """A JSON object at URL/rel (None when absent); LayoutError naming it when it is not one."""
        try:
            data = self._call(self.fs.cat_file, self.path(rel))
        except FileNotFoundError:
            return None
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise layout.LayoutError(f"{self.url}/{rel}: {what} is not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise layout.LayoutError(f"{self.url}/{rel}: {what} must hold a JSON object")
        return obj

    # ------------------------------------------------------------------------------ transfers
    def put(self, local: Path, rel: str) -> None:
        self._call(self.fs.put_file, str(local), self.path(rel))

    def put_bytes(self, data: bytes, rel: str) -> None:
        self._call(self.fs.pipe_file, self.path(rel), data)

    def get(self, rel: str, local: Path) -> None:
        self._call(self.fs.get_file, self.path(rel), str(local))

    def remove(self, rel: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(self.fs.rm, self.path(rel), recursive=recursive)

    # ----------------------------------------------------------------------------- checkpoints
    def upload_checkpoint(self, local: Path, step: int) -> None:
        """Every file of the checkpoint folder `local`, then its commit marker (sizes and sha256) last."""
        name = layout.STEP_PREFIX + f"{step:07d}"
        files = {}
        for f in sorted(p for p in local.iterdir() if p.is_file()):
            files[f.name] = file_digest(f)
            self.put(f, f"{layout.CHECKPOINTS}/{name}/{f.name}")
        key, version = COMMIT_FORMAT
        marker = {key: version, "step": step, "files": files}
        self.put_bytes(json.dumps(marker, indent=1).encode(), f"{layout.CHECKPOINTS}/{name}{COMMIT_SUFFIX}")

    def scan(self) -> tuple[list[tuple[int, dict]], list[str]]:
        """(committed checkpoints as (step, marker), oldest first; step folders no valid marker vouches for)."""
        names = self.names(layout.CHECKPOINTS)
        steps = {n for n in names if n.startswith(layout.STEP_PREFIX) and n[len(layout.STEP_PREFIX):].isdigit()}
        committed, partial = [], []
        for n in sorted(steps):
            marker = None
            if n + COMMIT_SUFFIX in names:
                try:
                    marker = self.read_json(f"{layout.CHECKPOINTS}/{n}{COMMIT_SUFFIX}", "commit marker")
                except layout.LayoutError:
                    marker = None
            files = marker.get("files") if isinstance(marker, dict) else None
            if isinstance(files, dict) and files and \
                    self.sizes(f"{layout.CHECKPOINTS}/{n}") == {k: v.get("size") for k, v in files.items()}:
                committed.append((int(n[len(layout.STEP_PREFIX):]), marker))
            else:
                partial.append(n)
        return committed, partial

    def download_checkpoint(self, step: int, marker: dict, dest: Path) -> bool:
        """The committed checkpoint into `dest` (a new folder), every sha256 checked: False when one differs."""
        name = layout.STEP_PREFIX + f"{step:07d}"
        tmp = dest.with_name(f".tmp-pull-{dest.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for fname, want in marker["files"].items():
                self.get(f"{layout.CHECKPOINTS}/{name}/{fname}", tmp / fname)
                if file_digest(tmp / fname) != {"size": want.get("size"), "sha256": want.get("sha256")}:
                    return False
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def remove_checkpoint(self, step_name: str) -> None:
        """The marker first (the checkpoint is gone the moment it is), then the files."""
        self.remove(f"{layout.CHECKPOINTS}/{step_name}{COMMIT_SUFFIX}")
        self.remove(f"{layout.CHECKPOINTS}/{step_name}", recursive=True)

    # ------------------------------------------------------------------------------------ pull
    def pull(self, cache: Path, say: Any, *, newer_than: int = 0, step: int | None = None) -> int | None:
        """The newest committed checkpoint (or `step`) into cache/checkpoints/, then the run files, when it
        is newer than `newer_than`: its step, or None. Partial uploads above it are named in a warning;
        one whose files differ from its marker is skipped for the one before."""
        committed, partial = self.scan()
        newest = committed[-1][0] if committed else 0
        for name in partial:
            if int(name[len(layout.STEP_PREFIX):]) > newest:
                say(f"warning: {self.url}/{layout.CHECKPOINTS}/{name} is incomplete (no commit marker that "
                    "matches its files: an upload cut short); ignored")
        if step is not None:
            committed = [(s, m) for s, m in committed if s == step]
            if not committed:
                raise RemoteError(f"{self.url} holds no committed checkpoint of step {step}")
        for s, marker in reversed(committed):
            if s <= newer_than:
                break
            name = layout.STEP_PREFIX + f"{s:07d}"
            if self.download_checkpoint(s, marker, cache / layout.CHECKPOINTS / name):
                self.pull_run_files(cache)
                say(f"pulled {self.url}/{layout.CHECKPOINTS}/{name} into {cache}")
                return s
            say(f"warning: {self.url}/{layout.CHECKPOINTS}/{name}: a file differs from its commit marker's "
                "sha256; ignored")
        return None

    def pull_run_files(self, cache: Path) -> None:
        cache.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            tmp = cache / f".tmp-pull-{name}"
            try:
                self.get(name, tmp)
            except FileNotFoundError:
                continue
            os.replace(tmp, cache / name)


def pull_run(url: str, step: int | None, say: Any, flag: str = "RUN_DIR") -> Path:
    """A run at `url` as a local run folder (its default cache) holding its newest committed checkpoint
    (or `step`): what `python -m export ... s3://BUCKET/RUN` reads. RemoteError when it holds none."""
    r = Remote(url, flag)
    try:
        r.check()
    except Unreachable as e:
        raise RemoteError(f"{flag} {url}: {e}") from None
    cache = cache_dir(r.url)
    if r.pull(cache, say, step=step) is None:
        raise RemoteError(f"{flag} {r.url}: holds no committed checkpoint (not a prodip run, or none uploaded yet)")
    return cache


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


def pull_data(url: str, say: Any, flag: str = "--data") -> Path:
    """A data folder at `url` (written by training.prepare, uploaded as is) as a local folder: pulled once
    into data_cache_dir(url), every file's size and MD5 (the store's ETag) checked, and pulled again only
    when the store's listing changes or a cached file lost its size. A store that does not answer is
    fine when the folder was pulled before (a warning); else RemoteError."""
    r = Remote(url, flag)
    dest = data_cache_dir(r.url)
    record = dest / PULLED
    try:
        r.check()
        found = r._call(r.fs.find, r.root, detail=True)
    except Unreachable as e:
        if record.is_file():
            say(f"warning: {e}; using the copy pulled before, {dest}")
            return dest
        raise RemoteError(f"{flag} {r.url}: {e}, and it was never pulled to this machine") from None
    listing = {k[len(r.root) + 1:]: {"size": int(v.get("size") or 0), "etag": str(v.get("ETag", ""))}
               for k, v in found.items() if v.get("type") == "file" and k.startswith(r.root + "/")}
    if not listing:
        raise RemoteError(f"{flag} {r.url}: holds no files (expected a folder written by `python -m training.prepare`)")
    if record.is_file() and json.loads(record.read_text()) == listing and \
            all((dest / k).is_file() and (dest / k).stat().st_size == v["size"] for k, v in listing.items()):
        return dest
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, v in listing.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            r.get(rel, tmp / rel)
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

