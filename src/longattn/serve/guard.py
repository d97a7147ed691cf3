"""What a request must pass before any route sees it: the Host header, the API key, the body's
size and type. A pure ASGI middleware, so a refused request costs no body read and no model
work, and streaming responses pass through untouched.

- **Host** (when ``allowed_hosts`` is set, as it is for a loopback-bound server): a page the
  user opens in a browser can resolve its own domain to 127.0.0.1 (DNS rebinding) and then
  talk to the local server as a same-origin page; its requests carry that domain in ``Host``,
  so anything but a loopback name is refused (421).
- **API key** (when set): ``Authorization: Bearer <key>`` on every ``/v1`` route, compared in
  constant time; 401 shaped as OpenAI's.
- **Content type**: a POST body must be ``application/json``. A browser sends a cross-origin
  ``text/plain`` or form POST without asking first (a "simple request"); a JSON POST needs a
  CORS preflight, which this server never grants.
- **Size**: a declared ``Content-Length`` above ``max_body`` is refused (413) before a byte is
  read; a chunked body is counted as it arrives and cut at the same limit.
"""

from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass, field
from typing import Optional

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

log = logging.getLogger("longattn.serve")


@dataclass
class ServeOptions:
    """What the HTTP layer enforces (the CLI's flags; the defaults are the safe ones)."""
    api_key: Optional[str] = None                 # None: no key required
    max_body: int = 4 << 20                       # bytes of a request body
    max_prompt_tokens: int = 131072               # tokens of one prompt after templating
    allowed_hosts: Optional[frozenset] = field(default=LOOPBACK_HOSTS)  # None: any Host
    docs: bool = False                            # serve /docs and /openapi.json
    tokenizer_threads: int = 2                    # tokenization and templating off the event loop


class BodyTooLarge(Exception):
    """Raised by the counted ``receive`` once a body passes ``max_body`` (the route answers 413)."""


def error_body(message: str, kind: str, code: Optional[str] = None, param: Optional[str] = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def too_large(limit: int) -> str:
    return f"the request body exceeds the server's limit of {limit} bytes (--max-body)"


def host_name(host: str) -> str:
    """``Host`` header -> its name without port: ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """ASGI middleware enforcing ``ServeOptions`` around ``app``; counts refusals in
    ``refused`` (by reason) for /metrics."""

    def __init__(self, app, options: ServeOptions, refused: dict):
        self.app, self.opt, self.refused = app, options, refused
        self.key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path, method = scope.get("path", ""), scope.get("method", "GET")
        refusal = self._check(headers, path, method)
        if refusal is not None:
            status, message, kind, code, extra = refusal
            self.refused[code] = self.refused.get(code, 0) + 1
            log.info("%s %s %d %s", method, path[:200], status, code)
            return await _answer(send, status, error_body(message, kind, code), extra)
        if method == "POST":
            receive = self._counted(receive)
        await self.app(scope, receive, send)

    def _check(self, headers: dict, path: str, method: str):
        opt = self.opt
        if opt.allowed_hosts is not None and "host" in headers and host_name(headers["host"]) not in opt.allowed_hosts:
            return (421, f"this server answers only to {', '.join(sorted(opt.allowed_hosts))} as Host "
                         f"(got '{headers['host'][:100]}')", "invalid_request_error", "host_not_allowed", {})
        if self.key is not None and path.startswith("/v1"):
            auth = headers.get("authorization", "")
            token = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not hmac.compare_digest(token, self.key):
                what = "no API key was provided" if not token else "the API key is not valid"
                return (401, f"{what}; send it as 'Authorization: Bearer <key>'", "invalid_request_error",
                        "invalid_api_key", {"www-authenticate": "Bearer"})
        if method == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return (415, f"the body must be JSON sent as 'Content-Type: application/json' "
                             f"(got '{ctype[:100] or 'none'}')", "invalid_request_error", "unsupported_media_type", {})
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > opt.max_body):
                return (413, self._too_large(), "invalid_request_error", "body_too_large", {})
        return None

    def _too_large(self) -> str:
        return too_large(self.opt.max_body)

    def _counted(self, receive):
        """``receive`` that raises BodyTooLarge once the body passes the limit (chunked bodies)."""
        seen = 0

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.opt.max_body:
                    raise BodyTooLarge()
            return message
        return wrapped


async def _answer(send, status: int, body: bytes, extra: Optional[dict] = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    # the client may still be sending a body the server will not read: close the connection
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
