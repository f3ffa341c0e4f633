"""A run folder in object storage: the URL, the fsspec calls (s3fs for s3://), the commit markers.

    URL/.prodip_run  run.json  log.jsonl  gates.json  tokenizer.model  curves.png ...   (the run files)
    URL/checkpoints/step_0000100/{model.safetensors, optim.safetensors, state.json, ...}
    URL/checkpoints/step_0000100.commit.json   written last: {"prodip_commit": 1, "step", "files": {name: {size, sha256}}}
    URL/export/{manifest.json, gguf/..., ...}  URL/export.commit.json   (`python -m export` writes back; same marker)

Object stores have no atomic rename, so a checkpoint is visible only through its commit marker,
uploaded after every file of it (`Remote.commit`, also what writes exports back): `scan()` lists the
checkpoints whose marker names files of exactly those sizes and the step folders without one (an
upload cut short), and a download checks every sha256 against the marker. Removal deletes the marker
first. A --data URL is pulled by training.store.remote_data.

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

from training.runfiles import layout
from training.runfiles.file_ops import sha256_file
from training.runfiles.json_records import loads as bounded_loads
from training.runfiles.schema import URL_STORES
from training.store.urls import RemoteError, check_marker, is_url, parse_url

__all__ = ["RemoteError", "is_url"]  # defined in training.store.urls (the URL type), imported from here by the stages

COMMIT_SUFFIX = ".commit.json"
COMMIT_FORMAT = ("prodip_commit", 1)
EXPORT_COMMIT = layout.EXPORT + COMMIT_SUFFIX  # URL/export.commit.json: exports written back (export.writeback)
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


class Unreachable(OSError):
    """The store did not answer (network, server down): the mirror retries; nothing is wrong with the input."""


def split_url(url: str, flag: str = "--out") -> tuple[str, str]:
    """(scheme, "bucket/prefix/run") of a store URL (training.store.urls.parse_url); RemoteError naming `flag` otherwise."""
    u = parse_url(url, flag)
    return u.scheme, u.root


def _url_key(url: str) -> str:
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def cache_dir(url: str) -> Path:
    """The default local cache of a run at `url`: ~/.cache/prodip/runs/<sha256 of the URL, 16 hex>/<its last
    name>, so the folder is named as the run (exports, cards and curves are named for it, not for a hash)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return CACHE_ROOT.expanduser() / _url_key(url) / name


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


def store_refusal(e: BaseException) -> str:
    """A store's (or its client's) refusal in one line: an endpoint that is not a URL, a bucket name the
    store rejects, any other error, by its class and first line (botocore never puts a secret there)."""
    text = " ".join(str(e).split())[:300] or "no message"
    if "endpoint" in text.lower() and isinstance(e, ValueError):
        env = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
        return f"{env} is not a valid endpoint URL ({text})"
    if "bucket" in text.lower() and ("valid" in text.lower() or "name" in text.lower()):
        return f"the store rejects the bucket name ({type(e).__name__}: {text})"
    return f"the store refused the request ({type(e).__name__}: {text})"


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
            raise RemoteError(f"{self.flag} {self.url}: {store_refusal(e)}") from None

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
            obj = bounded_loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError and the bounds' JSONBoundError
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
    def commit(self, files: dict[str, Path], rel_dir: str, marker_rel: str, **extra: Any) -> dict:
        """Every file (keyed by its path under URL/rel_dir) uploaded, then the commit marker naming each
        one's size and sha256, last: the one commit mechanism of checkpoints and written-back exports."""
        digests = {}
        for name, local in sorted(files.items()):
            digests[name] = file_digest(local)
            self.put(local, f"{rel_dir}/{name}")
        key, version = COMMIT_FORMAT
        marker = {key: version, **extra, "files": digests}
        self.put_bytes(json.dumps(marker, indent=1).encode(), marker_rel)
        return marker

    def read_marker(self, marker_rel: str) -> dict | None:
        """The commit marker at URL/marker_rel checked by its schema (training.store.urls.CommitMarker): None when
        it is absent or damaged (not JSON, the wrong shape, a file name leaving its folder): either way
        nothing vouches for the files, as after an upload cut short."""
        try:
            obj = self.read_json(marker_rel, "commit marker")
            return None if obj is None else check_marker(obj, f"{self.url}/{marker_rel}")
        except (layout.LayoutError, RemoteError):
            return None

    def read_commit(self, rel_dir: str, marker_rel: str) -> dict | None:
        """The commit marker at URL/marker_rel when it names exactly the files under URL/rel_dir (every
        depth), at their sizes; else None (absent, damaged, or an upload cut short)."""
        marker = self.read_marker(marker_rel)
        if marker is None:
            return None
        try:
            found = self._call(self.fs.find, self.path(rel_dir), detail=True)
        except FileNotFoundError:
            found = {}
        base = self.path(rel_dir) + "/"
        sizes = {k[len(base):]: int(v.get("size") or 0) for k, v in found.items()
                 if v.get("type") == "file" and k.startswith(base)}
        return marker if sizes == {k: v["size"] for k, v in marker["files"].items()} else None

    def get_verified(self, rel: str, local: Path, want: dict) -> bool:
        """URL/rel into `local`; False (and `local` removed) when its size or sha256 is not the marker's."""
        local.parent.mkdir(parents=True, exist_ok=True)
        self.get(rel, local)
        if file_digest(local) == {"size": want.get("size"), "sha256": want.get("sha256")}:
            return True
        local.unlink(missing_ok=True)
        return False

    def upload_checkpoint(self, local: Path, step: int) -> None:
        """Every file of the checkpoint folder `local`, then its commit marker (sizes and sha256) last."""
        name = f"{layout.CHECKPOINTS}/{layout.STEP_PREFIX}{step:07d}"
        self.commit({f.name: f for f in local.iterdir() if f.is_file()}, name, name + COMMIT_SUFFIX, step=step)

    def scan(self) -> tuple[list[tuple[int, dict]], list[str]]:
        """(committed checkpoints as (step, marker), oldest first; step folders no valid marker vouches for)."""
        names = self.names(layout.CHECKPOINTS)
        steps = {n for n in names if n.startswith(layout.STEP_PREFIX) and n[len(layout.STEP_PREFIX):].isdigit()}
        committed, partial = [], []
        for n in sorted(steps):
            step = int(n[len(layout.STEP_PREFIX):])
            marker = self.read_marker(f"{layout.CHECKPOINTS}/{n}{COMMIT_SUFFIX}") if n + COMMIT_SUFFIX in names else None
            if marker is not None and marker.get("step", step) == step and \
                    self.sizes(f"{layout.CHECKPOINTS}/{n}") == {k: v["size"] for k, v in marker["files"].items()}:
                committed.append((step, marker))
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
                if not self.get_verified(f"{layout.CHECKPOINTS}/{name}/{fname}", tmp / fname, want):
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


def pull_export(url: str, say: Any, flag: str = "MODEL") -> Path:
    """A file (or folder) of a run's written-back export, URL = RUN/export/REL, as a local path in the
    run's cache (CACHE/export/REL), every file's sha256 checked against RUN/export.commit.json (files
    already there with that sha256 are kept): what `python -m serving s3://BUCKET/RUN/export/...` loads."""
    scheme, root = split_url(url, flag)
    run_root, sep, rel = root.partition(f"/{layout.EXPORT}/")
    rel = rel.strip("/")
    if not sep or not rel:
        raise RemoteError(f"{flag} {url}: expected a file of a run's written-back export, "
                          f"{scheme}://BUCKET/RUN/{layout.EXPORT}/gguf/NAME.gguf (python -m export writes them)")
    r = Remote(f"{scheme}://{run_root}", flag)
    try:
        r.check()
        marker = r.read_commit(layout.EXPORT, EXPORT_COMMIT)
    except Unreachable as e:
        raise RemoteError(f"{flag} {url}: {e}") from None
    if marker is None:
        raise RemoteError(f"{flag} {url}: {r.url} holds no committed export (`python -m export gguf {r.url}` "
                          "writes one back)")
    want = {k: v for k, v in marker["files"].items() if k == rel or k.startswith(rel + "/")}
    if not want:
        raise RemoteError(f"{flag} {url}: not in {r.url}'s committed export (it holds {', '.join(sorted(marker['files']))})")
    dest = cache_dir(r.url) / layout.EXPORT
    for name, digest in want.items():
        local = dest / name
        if local.is_file() and file_digest(local) == {"size": digest.get("size"), "sha256": digest.get("sha256")}:
            continue
        tmp = local.with_name(f".tmp-pull-{local.name}")
        if not r.get_verified(f"{layout.EXPORT}/{name}", tmp, digest):
            raise RemoteError(f"{flag} {url}: {name} differs from its commit marker's sha256; run the same command again")
        os.replace(tmp, local)
    say(f"pulled {url} ({len(want)} files, sha256 checked) into {dest / rel}")
    return dest / rel
