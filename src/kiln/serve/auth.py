"""API keys: with keys configured, every HTTP route but /health needs `Authorization: Bearer KEY`.

Keys are held only as SHA-256 digests. A presented key is hashed and compared with every stored
digest by `hmac.compare_digest`, without stopping at a match, so the time taken says nothing
about how much of a key was right or which key matched. Auth runs before the body is read, so
an unauthenticated request is refused before any parsing or tokenization.
A missing key gets 401 with `code: null` and a wrong one 401 `invalid_api_key`, as OpenAI does.

Tenancy: each key is a tenant. Its prefix-cache salt is HMAC-SHA256(a secret drawn when the
server starts, the key's digest), set here after the key checks out and read by the handlers
(`tenant_salt`); a client can never choose it, so tenants never share cached KV blocks (no
prefix-timing side channel between keys). Without keys there is one tenant and no salt.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.serve.errors import APIError

OPEN_PATHS = frozenset({"/health"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyStore:
    def __init__(self, keys: tuple[str, ...]):
        self._digests = [_digest(k) for k in keys]
        self._salt_secret = secrets.token_bytes(32)

    def salt_for(self, key: str) -> str:
        """The tenant's prefix-cache salt for a key that checked out."""
        return hmac.new(self._salt_secret, _digest(key), hashlib.sha256).hexdigest()[:32]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, presented: str) -> bool:
        """Constant-time membership: every stored digest is compared."""
        digest = _digest(presented)
        found = False
        for stored in self._digests:
            found |= hmac.compare_digest(digest, stored)
        return found


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class APIKeyAuth:
    """ASGI middleware enforcing the keys of a KeyStore (a no-op when it holds none)."""

    def __init__(self, app: ASGIApp, keys: KeyStore):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope)
        if token is None:
            error = APIError(401, "no API key given; send it as 'Authorization: Bearer KEY'")
        elif not self.keys.check(token):
            error = APIError(401, "incorrect API key", code="invalid_api_key")
        else:
            scope.setdefault("state", {})["cache_salt"] = self.keys.salt_for(token)
            return await self.app(scope, receive, send)
        await error.response()(scope, receive, send)


def tenant_salt(request: Request) -> str | None:
    """The prefix-cache salt of the request's tenant (None when the server has no keys)."""
    return request.scope.get("state", {}).get("cache_salt")
