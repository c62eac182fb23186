"""HTTP to SGLang servers, with the standard library only (attaching to running servers needs no sglang
package): one request with its JSON body and answer, an error answer's message, and a POST to every server.
Every other part of the engine reaches the servers through `SGLangClient`, so the transport and its errors
(SGLangServerError for a server that cannot be reached) are decided here once."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import List, Optional, Sequence

from .errors import SGLangServerError


def http_request(method: str, url: str, body: Optional[dict], timeout: float):
    """(status, parsed JSON or text) for one request; SGLangServerError when the server cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SGLangServerError(f"cannot reach SGLang server at {url}: {reason}") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return status, text


def server_message(payload) -> str:
    """What an answer says: SGLang's {"error": {"message"}} or {"message"}, else the payload (cut short)."""
    if isinstance(payload, dict):
        if isinstance(payload.get("error"), dict) and "message" in payload["error"]:
            return str(payload["error"]["message"])
        if "message" in payload:
            return str(payload["message"])
    return str(payload)[:500]


class SGLangClient:
    """The engine's servers as HTTP endpoints: `urls` (base URLs, in order: server i is urls[i]) and the
    per-request timeout."""

    def __init__(self, urls: Sequence[str], timeout_s: float) -> None:
        self.urls = list(urls)
        self.timeout_s = timeout_s

    def get(self, url: str, path: str):
        return http_request("GET", url + path, None, self.timeout_s)

    def post(self, url: str, path: str, body: Optional[dict]):
        return http_request("POST", url + path, body, self.timeout_s)

    def post_all(self, path: str, body: Optional[dict], what: str) -> List:
        """POST `body` to every server in turn; SGLangServerError naming `what` and the server at the first
        that answers with an error (or with success false)."""
        out = []
        for url in self.urls:
            status, payload = self.post(url, path, body)
            ok = status == 200 and not (isinstance(payload, dict) and payload.get("success") is False)
            if not ok:
                raise SGLangServerError(f"{what} failed on {url} (HTTP {status}): {server_message(payload)}")
            out.append(payload)
        return out
