"""A fake Hugging Face Hub on 127.0.0.1: what huggingface_hub 2.x and the store's downloader ask.

``GET /api/models/{repo}[/revision/{rev}]`` -> ``{id, sha, cardData}``;
``GET /api/models/{repo}/tree/{sha}?recursive=…`` -> ``[{type, path, size, oid, lfs}]``;
``HEAD``/``GET /{repo}/resolve/{sha}/{path}`` with ``X-Repo-Commit``, ``ETag``,
``Content-Length`` and ``Range`` (206). Every request is recorded; a repo may be gated, its
listing overridden (hostile sizes and paths), and its downloads slowed (to be killed midway).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = ""
    gated: bool = False
    listing: list | None = None  # served instead of the real tree (hostile answers)
    license: str = "apache-2.0"

    def __post_init__(self):
        if not self.sha:
            digest = hashlib.sha1()
            for path, data in sorted(self.files.items()):
                digest.update(path.encode() + hashlib.sha1(data).digest())
            self.sha = digest.hexdigest()

    def tree(self) -> list[dict]:
        if self.listing is not None:
            return self.listing
        out = []
        for path, data in sorted(self.files.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if path.endswith((".safetensors", ".gguf")):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    slow: float = 0.0  # seconds slept per 4 kB sent while set
    stall: float = 0.0  # seconds every answer waits before its first byte (a silent Hub)
    page_size: int = 1000  # tree entries a page (the Hub's 1,000), then a Link to the next
    url: str = ""

    def gets(self, suffix: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and r[1].endswith(suffix)]


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)$")


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, status: int, body, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _repo(self, name: str) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._json(404, {"error": "Repository not found"},
                           {"X-Error-Code": "RepoNotFound"})  # fmt: skip
                return None
            if repo.gated and "authorization" not in {k.lower() for k in self.headers}:
                self._json(401, {"error": f"Access to model {name} is restricted."},
                           {"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"})  # fmt: skip
                return None
            return repo

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if hub.stall:
                time.sleep(hub.stall)
            if m := _TREE.match(path):
                if (repo := self._repo(m["repo"])) is not None:
                    start = int(parse_qs(urlsplit(self.path).query).get("cursor", ["0"])[0])
                    tree, end = repo.tree(), start + hub.page_size
                    link = {}
                    if end < len(tree):
                        link["Link"] = f'<{hub.url}{path}?recursive=true&cursor={end}>; rel="next"'
                    self._json(200, tree[start:end], link)
            elif m := _INFO.match(path):
                if (repo := self._repo(m["repo"])) is not None:
                    if m["rev"] not in (None, "main", repo.sha):
                        self._json(404, {"error": "Invalid rev id"},
                                   {"X-Error-Code": "RevisionNotFound"})  # fmt: skip
                        return
                    body = {"id": m["repo"], "sha": repo.sha, "private": False,
                            "cardData": {"license": repo.license}, "tags": []}  # fmt: skip
                    self._json(200, body)
            elif m := _RESOLVE.match(path):
                if (repo := self._repo(m["repo"])) is None:
                    return
                data = repo.files.get(m["path"])
                if data is None or m["rev"] not in ("main", repo.sha):
                    self._json(404, {"error": "Entry not found"},
                               {"X-Error-Code": "EntryNotFound"})  # fmt: skip
                    return
                self._send_file(repo, data)
            else:
                self._json(404, {"error": f"no route {path}"})

        def _send_file(self, repo: Repo, data: bytes) -> None:
            start, status = 0, 200
            if r := re.match(r"bytes=(\d+)-$", self.headers.get("Range") or ""):
                start, status = int(r.group(1)), 206
            body = data[start:]
            self.send_response(status)
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(body)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            for i in range(0, len(body), 4096):
                self.wfile.write(body[i : i + 4096])
                self.wfile.flush()
                if hub.slow:
                    time.sleep(hub.slow)

    return Handler


class Serving:
    def __init__(self, hub: FakeHub):
        self.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client that hung up: fine
        hub.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
