"""What every request passes before the app reads it: the API key on /v1 (compared in constant time) and the body's
size (from Content-Length, then counted as it arrives), so neither a stranger nor a huge body costs a parse."""
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmc.runtime.serving.error_responses import error_response


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith("/v1") and not self._authorized(headers):
            await error_response(401, "invalid or missing API key", "authentication_error")(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_request_bytes:
            await self._too_large(scope, receive, send)
            return
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.max_request_bytes:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        await self.app(scope, replay(b"".join(body), receive), send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        return hmac.compare_digest(headers.get(b"authorization", b""), self.expected)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over this server's limit of {self.max_request_bytes} bytes (--max-request-bytes)"
        await error_response(413, message, "invalid_request_error")(scope, receive, send)


def replay(body: bytes, receive: Receive) -> Receive:
    """The body read already, then the client's own messages (its disconnect, when it goes)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
