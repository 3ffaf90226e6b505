"""A small Hugging Face Hub on the loopback, for tests: the file endpoints that huggingface_hub downloads through.

    python -m tests.hub_server ROOT PORT

Repositories are folders ROOT/<org>/<name>/<commit>/<files>, with branches and tags as ROOT/<org>/<name>/refs/<rev>
holding a commit. `HEAD|GET /<org>/<name>/resolve/<rev>/<file>` answers as the Hub does: the commit in X-Repo-Commit,
the file's hash as ETag, its size, and the Hub's X-Error-Code on a 404. Every GET is appended to ROOT/gets.log.
ROOT/<org>/<name>/faults.json injects failures: {"truncate": FILE} sends half of FILE and closes the connection,
{"understate": FILE} announces a 100-byte FILE on HEAD, {"slow_s": S} sleeps S seconds per 1 KiB chunk.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 1024


class HubHandler(BaseHTTPRequestHandler):
    root: Path

    def do_HEAD(self):
        self._answer(send_body=False)

    def do_GET(self):
        self._answer(send_body=True)

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, send_body: bool) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) != 5 or parts[2] != "resolve":
            return self._error(404, "EntryNotFound")
        org, name, _, rev, filename = parts
        repo = self.root / org / name
        if not repo.is_dir():
            return self._error(404, "RepoNotFound")
        ref = repo / "refs" / rev
        commit = ref.read_text().strip() if ref.is_file() else rev
        if not (repo / commit).is_dir() or commit == "refs":
            return self._error(404, "RevisionNotFound")
        path = repo / commit / filename
        if not path.is_file():
            return self._error(404, "EntryNotFound")
        faults = json.loads((repo / "faults.json").read_text()) if (repo / "faults.json").is_file() else {}
        data = path.read_bytes()
        announced = 100 if not send_body and faults.get("understate") == filename else len(data)
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(announced))
        self.end_headers()
        if send_body:
            with (self.root / "gets.log").open("a") as log:
                log.write(f"{org}/{name}/{commit}/{filename}\n")
            self._send(data, faults, filename)

    def _send(self, data: bytes, faults: dict, filename: str) -> None:
        if faults.get("truncate") == filename:
            data = data[: len(data) // 2]
        for start in range(0, len(data), CHUNK):
            self.wfile.write(data[start:start + CHUNK])
            time.sleep(faults.get("slow_s", 0))
        if faults.get("truncate") == filename:
            self.close_connection = True

    def _error(self, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def main(root: str, port: int) -> None:
    HubHandler.root = Path(root)
    ThreadingHTTPServer(("127.0.0.1", port), HubHandler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
