"""What a request must be before it reaches a route: sent to an allowed Host, with the
key, as JSON, of bounded size.

A local server is reachable from any web page the user visits: a page can POST a
simple `text/plain` request (no CORS preflight), and a page on a name rebound to
127.0.0.1 (DNS rebinding) is same-origin with the server.  So POST bodies must be JSON
(a cross-origin JSON POST needs a preflight, which fails without --allowed-origins),
and the Host header must name a loopback address or a name given with --allowed-hosts
(a rebound name does not).  Starlette's TrustedHostMiddleware is not used: it answers
in plain text ("Invalid host header"), not with OpenAI's error body that clients parse,
and it matches names only (127.0.0.0/8 is loopback as a whole)."""
from __future__ import annotations

import hmac
import ipaddress
import json

from starlette.requests import ClientDisconnect, Request

from .protocol import ApiError

MAX_BODY = 1 << 20       # bytes; a max_seq prompt is a few dozen kB
LOOPBACK_NAMES = ("localhost",)


class ClientGone(Exception):
    """The client hung up before its request body was all sent."""


def host_name(header: str) -> str:
    """The host of a Host header, without its port: "[::1]:8080" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: refuses a Host that is neither loopback nor allowed (403, JSON),
    and tells `on_status(path, status)` the status of every HTTP response."""

    def __init__(self, app, allowed_hosts=(), on_status=None):
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.allowed = {h.strip().lower().strip("[]") for h in allowed_hosts}
        self.on_status = on_status

    def allows(self, header: str | None) -> bool:
        if self.any_host:
            return True
        host = host_name(header or "")
        return bool(host) and (is_loopback(host) or host in self.allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def send_and_count(message):
            if message["type"] == "http.response.start" and self.on_status is not None:
                self.on_status(path, message["status"])
            await send(message)

        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.allows(host):
            return await self.app(scope, receive, send_and_count)
        err = ApiError(403, f"Host {host!r} is not allowed: use a loopback address, or start the server "
                            f"with --allowed-hosts NAME", type="invalid_request_error", code="host_not_allowed")
        await send_and_count({"type": "http.response.start", "status": 403,
                              "headers": [(b"content-type", b"application/json")]})
        await send_and_count({"type": "http.response.body", "body": json.dumps(err.body()).encode()})


def authorized(request: Request, api_key: str | None) -> bool:
    """Whether the request carries the key ("Authorization: Bearer KEY"; the scheme is
    case-insensitive, RFC 7235); always, when the server has none."""
    if api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def require_key(request: Request, api_key: str | None):
    if not authorized(request, api_key):
        raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                       type="invalid_request_error", code="invalid_api_key")


def require_json(request: Request):
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be sent as Content-Type: application/json, not {media or 'none'!r}",
                       code="unsupported_media_type")


async def read_body(request: Request) -> bytes:
    """The request body, refused past MAX_BODY before it is all read; ClientGone when
    the client hangs up mid-body."""
    too_big = ApiError(413, f"the body is larger than {MAX_BODY} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)
