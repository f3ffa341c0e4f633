"""A real S3-compatible server for the remote-run tests (tests/test_remote.py): moto's server mode
on 127.0.0.1, restartable on the same port (a store that goes down and comes back), with a hold: a
PUT whose path contains `hold` waits in the server until released, then fails (a link that dies in
the middle of an upload). Clients are real s3fs/botocore ones; no file system is mocked."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_reliability import child_env, train_argv

SECRET = "prodip-test-secret-never-printed"  # the tests look for it in every output and file
REGION = "us-east-1"
TIMEOUT_S = 300


class S3Server:
    """moto's WSGI app behind werkzeug's threaded server, on 127.0.0.1 (see the module doc)."""

    def __init__(self) -> None:
        self.port = 0
        self.hold = ""  # a PUT whose path holds this string waits for `release`, then fails
        self.held = threading.Event()
        self.release = threading.Event()
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)

        def gated(environ, start_response):
            if self.hold and environ.get("REQUEST_METHOD") == "PUT" and self.hold in environ.get("PATH_INFO", ""):
                self.held.set()
                self.release.wait(120)
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"held and dropped by the test"]
            return app(environ, start_response)

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = make_server("127.0.0.1", self.port, gated, threaded=True, request_handler=MotoRequestHandler)
        self.port = self._server.server_address[1]  # kept: a restart listens on the same port
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Down for real: the listening socket is closed, so a client's connect is refused."""
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None
        self.release.clear()

    def env(self) -> dict[str, str]:
        """The standard AWS variables a user sets for an S3-compatible store (nothing from ~/.aws is read)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "prodip-test-key",
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def fs(self):
        """A real s3fs client of this server (the tests' own view of the store)."""
        import s3fs

        return s3fs.S3FileSystem(key="prodip-test-key", secret=SECRET, skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": self.endpoint})


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server().start()
    yield server
    server.stop()


# ------------------------------------------------------------------------------ the tests' helpers
def remote_argv(data: Path, url: str, cache: Path, *extra: str, steps: int = 8, save_every: int = 2) -> list[str]:
    """training/train.py's tiny test run, into the store URL `url` through the local cache `cache`."""
    argv = train_argv(data, Path("placeholder"), "--cache", str(cache), *extra, steps=steps, save_every=save_every)
    argv[argv.index("--out") + 1] = url
    return argv


def remote_env(server: S3Server, **more: str) -> dict[str, str]:
    return {**child_env(), **server.env(), **more}


def bucket(server: S3Server, name: str) -> str:
    server.fs().mkdir(name)
    return name


def committed_steps(fs, root: str) -> list[int]:
    """Steps whose commit marker is in the store (read by the test's own client)."""
    fs.invalidate_cache()
    if not fs.exists(f"{root}/checkpoints"):
        return []
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/checkpoints", refresh=True)]
    return sorted(int(n[5:12]) for n in names if n.endswith(".commit.json"))


def no_secret(*texts: str, roots: tuple[Path, ...] = (), fs=None, remote_root: str = "") -> None:
    """The secret key is in no output, no file under `roots`, no object under `remote_root`."""
    for t in texts:
        assert SECRET not in t
    for root in roots:
        for p in root.rglob("*"):
            assert not p.is_file() or SECRET.encode() not in p.read_bytes(), p
    if fs is not None:
        for key in fs.find(remote_root):
            assert SECRET.encode() not in fs.cat_file(key), key
