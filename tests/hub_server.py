"""A local stand-in for the Hugging Face Hub, on 127.0.0.1, for testing `glasslm download` with the real
huggingface_hub client (found through HF_ENDPOINT) and no network.

It answers what huggingface_hub 2.x asks when it downloads a snapshot, the way the hub does:
  GET  /api/models/{repo}/auth-check       whether the token may read the repository (auth_check)
  GET  /api/models/{repo}[/revision/{rev}] the commit a branch or tag names, else main's (model_info)
  GET  /api/models/{repo}/tree/{rev}       the files, with git blob ids and, for LFS files, sha256 and size
  HEAD /{repo}/resolve/{rev}/{file}        a small file: 200 with ETag (git blob id), X-Repo-Commit and
                                           Content-Length; an LFS file: 302 to a CDN on another origin, with
                                           X-Linked-Etag (sha256), X-Linked-Size and X-Repo-Commit
  GET  /{repo}/resolve/{rev}/{file}        the bytes (or the same 302), honouring Range
  GET  (CDN) /blobs/{sha256}               the bytes of an LFS file, honouring Range (206 + Content-Range)
and refuses as the hub does, with its X-Error-Code header: an unknown repository is 401 without a token
and 404 with one (RepoNotFound), an unknown revision 404 (RevisionNotFound), a gated file 401 without a
token and 403 with a token not granted (GatedRepo). `drop_once` makes the CDN cut the connection once,
part way through a file; every request is recorded in `log`.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")  # what a hub repository's .gitattributes sends to LFS


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    """A model repository: commits (sha -> {path: bytes}) and refs (branch or tag -> sha)."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated_token: str | None = None  # gated: only this token may download its files

    def add_commit(self, files: dict[str, bytes], *refs: str) -> str:
        sha = hashlib.sha1(repr(sorted((k, git_blob_id(v)) for k, v in files.items())).encode()).hexdigest()
        self.commits[sha] = {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", **files}
        self.refs.update({ref: sha for ref in refs})
        return sha

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorized: bool


class LocalHub:
    """The hub (`endpoint`, for HF_ENDPOINT) and its CDN, each a server thread; use as a context manager."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.log: list[Request] = []
        self.drop_once: dict[str, int] = {}  # sha256 of an LFS file -> cut the connection after this many bytes
        self._hub = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=False))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=True))
        self.endpoint = f"http://127.0.0.1:{self._hub.server_port}"
        self.cdn = f"http://127.0.0.1:{self._cdn.server_port}"

    def __enter__(self) -> "LocalHub":
        for server in (self._hub, self._cdn):
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def requests(self, method: str, pattern: str) -> list[Request]:
        return [r for r in self.log if r.method == method and re.search(pattern, r.path)]


def closed_endpoint() -> str:
    """An http://127.0.0.1 address where nothing listens: a hub that cannot be reached."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _handler(hub: LocalHub, cdn: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler if not cdn else _CdnHandler):
        pass

    Handler.hub = hub
    return Handler


class _BaseHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: LocalHub

    def log_message(self, *args) -> None:  # quiet: the tests read `hub.log`
        pass

    def _record(self) -> str:
        path = unquote(urlsplit(self.path).path)
        self.hub.log.append(Request(self.command, path, self.headers.get("Range"),
                                    self.headers.get("Authorization") is not None))
        return path

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", head: bool = False) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": headers.get("Content-Length", str(len(body)))}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message,
                            **(extra or {})}, body, head=self.command == "HEAD")

    def _send_bytes(self, data: bytes, headers: dict[str, str]) -> None:
        """The bytes, or the range asked for (206 + Content-Range, as the hub's CDN answers)."""
        start = 0
        asked = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if asked:
            start = int(asked.group(1))
            headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        self._send(206 if asked else 200, {**headers, "Accept-Ranges": "bytes"}, data[start:],
                   head=self.command == "HEAD")


class _HubHandler(_BaseHandler):
    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        path = self._record()
        api = re.fullmatch(r"/api/(models|datasets)/(.+?)/(revision|tree)/([^/]+)(/.*)?", path) \
            or re.fullmatch(r"/api/(models|datasets)/([^/]+(?:/[^/]+)?)/(auth-check)()", path) \
            or re.fullmatch(r"/api/(models|datasets)/([^/]+(?:/[^/]+)?)()()", path)  # no revision: the default branch
        resolve = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
        match = api or resolve
        if match is None:
            return self._error(404, "NotFound", f"no route {path}")
        # A dataset repository is kept as "datasets/<id>", as its files' URLs name it.
        repo_id, revision = ((api.group(2) if api.group(1) == "models" else f"datasets/{api.group(2)}"),
                             api.group(4) or "main") if api else (resolve.group(1), resolve.group(2))
        repo = self.hub.repos.get(repo_id)
        if repo is None:  # as the hub: 401 to the anonymous (not revealing private repositories), 404 otherwise
            authorized = self.headers.get("Authorization") is not None
            return self._error(404 if authorized else 401, "RepoNotFound", "Repository not found")
        commit = repo.commit_of(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if api and api.group(3) == "auth-check":
            return self._refuse_if_gated(repo_id, repo) or self._send(200, {"Content-Type": "application/json"}, b"{}")
        if api and api.group(3) in ("revision", ""):
            return self._model_info(repo_id, repo, commit)
        if api:
            return self._tree(repo.commits[commit], (api.group(5) or "").strip("/"))
        self._resolve(repo_id, repo, commit, resolve.group(3))

    def _refuse_if_gated(self, repo_id: str, repo: HubRepo) -> bool:
        """Answer 401 (no token) or 403 (a token not granted) with GatedRepo, as the hub does, and say so."""
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
        if not repo.gated_token or token == repo.gated_token:
            return False
        status, why = (403, "you are not in the authorized list") if token else (401, "please log in")
        self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted: {why}")
        return True

    def _model_info(self, repo_id: str, repo: HubRepo, commit: str) -> None:
        info = {"_id": git_blob_id(repo_id.encode()), "id": repo_id, "modelId": repo_id, "sha": commit,
                "private": False, "gated": "manual" if repo.gated_token else False, "disabled": False,
                "lastModified": "2025-01-01T00:00:00.000Z", "tags": [], "downloads": 0, "likes": 0,
                "siblings": [{"rfilename": name} for name in sorted(repo.commits[commit])]}
        self._send(200, {"Content-Type": "application/json"}, json.dumps(info).encode())

    def _tree(self, files: dict[str, bytes], folder: str = "") -> None:
        """The entries under `folder`: its files and folders, or with ?recursive=true everything below
        it (folders too), as the hub lists them."""
        recursive = "recursive=true" in (urlsplit(self.path).query or "").lower()
        prefix = f"{folder}/" if folder else ""
        entries, folders = [], set()
        for name, data in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folders.add(prefix + "/".join(parts[:depth]))
            if len(parts) > 1 and not recursive:
                continue
            entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": name}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "oid": git_blob_id(path.encode()), "size": 0, "path": path}
                    for path in sorted(folders)]
        self._send(200, {"Content-Type": "application/json"}, json.dumps(entries).encode())

    def _resolve(self, repo_id: str, repo: HubRepo, commit: str, name: str) -> None:
        files = repo.commits[commit]
        if name not in files:
            return self._error(404, "EntryNotFound", f"{name} does not exist on \"{commit}\"",
                               {"X-Repo-Commit": commit})
        if self._refuse_if_gated(repo_id, repo):
            return
        data = files[name]
        if name.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            return self._send(302, {"Location": f"{self.hub.cdn}/blobs/{sha256}", "X-Repo-Commit": commit,
                                    "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data)),
                                    "ETag": f'"{git_blob_id(data)}"'}, head=self.command == "HEAD")
        self._send_bytes(data, {"ETag": f'"{git_blob_id(data)}"', "X-Repo-Commit": commit,
                                "Content-Type": "application/octet-stream"})


class _CdnHandler(_BaseHandler):
    def do_GET(self) -> None:
        path = self._record()
        sha256 = path.removeprefix("/blobs/")
        blobs = {hashlib.sha256(data).hexdigest(): data for repo in self.hub.repos.values()
                 for files in repo.commits.values() for data in files.values()}
        if sha256 not in blobs:
            return self._error(404, "NotFound", "no such blob")
        cut = self.hub.drop_once.pop(sha256, None)
        if cut is None:
            return self._send_bytes(blobs[sha256], {"ETag": f'"{sha256}"', "Content-Type": "application/octet-stream"})
        # Promise the whole file, send part of it, and hang up: a connection lost mid-download.
        self.send_response(200)
        self.send_header("Content-Length", str(len(blobs[sha256])))
        self.end_headers()
        self.wfile.write(blobs[sha256][:cut])
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True
