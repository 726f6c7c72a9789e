"""A local stand-in for the parts of the Hugging Face Hub HTTP API that `HfApi.create_repo` and
`HfApi.upload_folder` use, served on 127.0.0.1 only, so the real client code path (headers, preupload, the
ndjson commit payload) runs end to end without the network.

Endpoints: `POST /api/repos/create`, `POST /api/validate-yaml`, `POST /api/models/{ns}/{name}/preupload/{rev}`
(every file is "regular", so contents travel inline in the commit), `POST /api/models/{ns}/{name}/commit/{rev}`
and `GET /api/models/{ns}/{name}/tree/{rev}` (the files the commits left, one page). `files` holds each repository's
current files: tests may seed it to stand for earlier pushes.
Every request must carry `Authorization: Bearer <token>`; anything else answers 404 and is recorded as unexpected.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_PREUPLOAD = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/?]+)")
_COMMIT = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/?]+)")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)")


@dataclass
class Commit:
    repo_id: str
    revision: str
    summary: str
    files: dict[str, bytes] = field(default_factory=dict)
    other_operations: list[dict] = field(default_factory=list)


class HubStandIn:
    def __init__(self, token: str = "hf_standin_write_token"):
        self.token = token
        self.requests: list[tuple[str, str]] = []
        self.unexpected: list[tuple[str, str]] = []
        self.repos: dict[str, dict] = {}
        self.commits: list[Commit] = []
        self.files: dict[str, dict[str, bytes]] = {}  # repo id -> path -> contents, after every commit
        self.preuploaded: list[str] = []
        self.validated_cards: list[str] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubStandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30  # a stuck client cannot hold a handler thread forever

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                standin._handle(self, "GET")

            def do_POST(self):
                standin._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------------------------------ handling
    def _reply(self, handler, status: int, payload: dict | list, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(body)

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        path = handler.path
        with self._lock:
            self.requests.append((method, path.split("?")[0]))
        if handler.headers.get("Authorization") != f"Bearer {self.token}":
            message = "Invalid credentials in Authorization header"
            return self._reply(handler, 401, {"error": message}, {"X-Error-Message": message})
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(handler, json.loads(body))
        if method == "POST" and path.startswith("/api/validate-yaml"):
            return self._validate_yaml(handler, json.loads(body))
        if method == "POST" and (match := _PREUPLOAD.match(path)):
            return self._preupload(handler, match["repo"], json.loads(body))
        if method == "POST" and (match := _COMMIT.match(path)):
            return self._commit(handler, match["repo"], match["rev"], body)
        if method == "GET" and (match := _TREE.match(path)):
            return self._tree(handler, match["repo"])
        with self._lock:
            self.unexpected.append((method, path))
        return self._reply(handler, 404, {"error": f"stand-in does not serve {method} {path}"})

    def _create_repo(self, handler, payload: dict) -> None:
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        url = f"{self.url}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                return self._reply(handler, 409, {"error": "You already created this model repo", "url": url})
            self.repos[repo_id] = payload
            self.files.setdefault(repo_id, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
        return self._reply(handler, 200, {"url": url, "name": repo_id, "id": "0" * 24})

    def _tree(self, handler, repo_id: str) -> None:
        if repo_id not in self.repos:
            return self._reply(handler, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        with self._lock:
            entries = [
                {"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for path, data in sorted(self.files.get(repo_id, {}).items())
            ]
        return self._reply(handler, 200, entries)

    def _validate_yaml(self, handler, payload: dict) -> None:
        # The Hub checks the card's metadata before a commit; the stand-in applies huggingface_hub's own parser.
        from huggingface_hub import ModelCard

        try:
            ModelCard(payload["content"])
        except Exception as error:  # noqa: BLE001 - any parse failure is a 400, as on the Hub
            return self._reply(handler, 400, {"errors": [{"message": str(error)}], "warnings": []})
        with self._lock:
            self.validated_cards.append(payload["content"])
        return self._reply(handler, 200, {"errors": [], "warnings": []})

    def _preupload(self, handler, repo_id: str, payload: dict) -> None:
        if repo_id not in self.repos:
            return self._reply(handler, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        files = [
            {"path": item["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
            for item in payload["files"]
        ]
        with self._lock:
            self.preuploaded.extend(item["path"] for item in payload["files"])
        return self._reply(handler, 200, {"files": files, "commitOid": "0" * 40})

    def _commit(self, handler, repo_id: str, revision: str, body: bytes) -> None:
        if repo_id not in self.repos:
            return self._reply(handler, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        commit = Commit(repo_id=repo_id, revision=revision, summary="")
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            if item["key"] == "header":
                commit.summary = item["value"]["summary"]
            elif item["key"] == "file" and item["value"].get("encoding") == "base64":
                commit.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            else:
                commit.other_operations.append(item)
        oid = hashlib.sha1(body).hexdigest()
        with self._lock:
            self.commits.append(commit)
            files = self.files.setdefault(repo_id, {})
            for item in commit.other_operations:
                if item["key"] == "deletedFile":
                    files.pop(item["value"]["path"], None)
            files.update(commit.files)
        return self._reply(handler, 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid})
