"""A tiny real HTTP server for tests: serves a directory on 127.0.0.1, with injectable faults.

    with FileServer(tmp_path / "www") as server:
        server.fail_first = 2          # answer 503 to the next two requests (of fail_method, if set)
        server.cut_after = 100         # then cut the next response body after 100 bytes
        requests.get(server.url("a/b.gz"))
        server.requests                # what was asked: [Request(method, path, headers, status)]

Faults are plain attributes, changeable between requests; each counter is used up
by the requests it affects. Range requests (`bytes=N-` and `bytes=N-M`) get 206
unless `honour_range` is False, in which case the whole file comes back with 200.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class Request:
    """One request the server answered."""

    method: str
    path: str
    headers: dict[str, str]
    status: int


class FileServer:
    """Serve `root` over HTTP/1.1 on a free port of 127.0.0.1 from a background thread."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.fail_first = 0  # answer the next K requests with `fail_status`
        self.fail_status = 503
        self.fail_method: str | None = None  # only requests of this method use up fail_first (None: all)
        self.cut_after: int | None = None  # send only this many body bytes, then drop the connection
        self.cut_times = 1  # how many responses `cut_after` applies to
        self.honour_range = True
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, relpath: str = "") -> str:
        """The URL that serves `root / relpath`."""
        return f"{self.base_url}/{urllib.parse.quote(relpath.lstrip('/'))}"

    def paths_requested(self) -> list[str]:
        return [r.path for r in self.requests]

    def __enter__(self) -> FileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def _take(self, attr: str) -> bool:
        """Use up one count of the fault counter `attr`, if any is left."""
        with self._lock:
            left = getattr(self, attr)
            if left > 0:
                setattr(self, attr, left - 1)
            return left > 0

    def _log(self, method: str, path: str, headers: dict[str, str], status: int) -> None:
        with self._lock:
            self.requests.append(Request(method, path, headers, status))

    def _file(self, url_path: str) -> Path | None:
        """The regular file under root that a URL path names, or None."""
        rel = urllib.parse.unquote(urllib.parse.urlsplit(url_path).path).lstrip("/")
        path = (self.root / rel).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            return None
        return path


def _handler_for(server: FileServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            headers = dict(self.headers.items())
            if server.fail_method in (None, self.command) and server._take("fail_first"):
                return self._status(server.fail_status, headers)
            path = server._file(self.path)
            if path is None:
                return self._status(404, headers)
            data = path.read_bytes()
            start, end, status = 0, len(data), 200
            match = _RANGE.match(self.headers.get("Range", ""))
            if match and server.honour_range:
                start = int(match[1])
                end = min(len(data), int(match[2]) + 1) if match[2] else len(data)
                if start >= len(data) or start >= end:
                    return self._status(416, headers, {"Content-Range": f"bytes */{len(data)}"})
                status = 206
            server._log(self.command, self.path, headers, status)
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes" if server.honour_range else "none")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            payload = data[start:end]
            if server.cut_after is not None and server._take("cut_times"):
                self.wfile.write(payload[: server.cut_after])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(payload)

        def _status(self, status: int, headers: dict[str, str], extra: dict[str, str] | None = None) -> None:
            server._log(self.command, self.path, headers, status)
            self.send_response(status)
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler
