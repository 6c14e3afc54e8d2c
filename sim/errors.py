"""SGLang-shaped error answers.

SGLang uses three different 400/5xx body shapes depending on where the error is raised,
and a streaming request sees some of them as an SSE `data: {"error": ...}` event with
HTTP 200 instead. `SimHttpError` carries both forms so handlers stay simple.
"""

from __future__ import annotations

from typing import Any

QUEUE_FULL_MESSAGE = "The request queue is full."


def openai_error_body(message: str, err_type: str, code: int) -> dict[str, Any]:
    """FastAPI `ErrorResponse` shape (used for 5xx, queue full and unparsable bodies)."""
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


def internal_error_body() -> dict[str, Any]:
    """The simulated 500 body."""
    return openai_error_body("Internal server error (simulated)", "InternalServerError", 500)


def queue_full_body() -> dict[str, Any]:
    """SGLang's 503 body when `--max-queued-requests` is exceeded (spec §5)."""
    return openai_error_body(QUEUE_FULL_MESSAGE, "503", 503)


def fault_body(status: int) -> dict[str, Any]:
    """Body of an injected failure with the given status."""
    if status == 503:
        return queue_full_body()
    if status == 500:
        return internal_error_body()
    return openai_error_body(f"Simulated failure ({status})", str(status), status)


class SimHttpError(Exception):
    """An error answer: HTTP status + JSON body, and whether streams get it as SSE.

    `sse` is True for errors SGLang raises inside `generate_request` (after the stream
    has begun): a streaming client then sees HTTP 200 with an error event.
    """

    def __init__(self, status: int, body: dict[str, Any], message: str, sse: bool) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.message = message
        self.sse = sse

    @classmethod
    def contract(cls, message: str) -> SimHttpError:
        """JSON-contract violation: 400 `{"error": "<text>"}`, HTTP even when streaming."""
        return cls(400, {"error": message}, message, sse=False)

    @classmethod
    def request(cls, message: str, status: int = 400) -> SimHttpError:
        """Tokenizer-manager ValueError: 400 `{"error": {"message": ...}}` or an SSE error."""
        return cls(status, {"error": {"message": message}}, message, sse=True)

    @classmethod
    def refusal(cls, message: str) -> SimHttpError:
        """A feature the simulator does not model (batch, text prompts)."""
        return cls(400, {"error": {"message": message}}, message, sse=False)

    @classmethod
    def bad_json(cls, message: str) -> SimHttpError:
        """Body that is not JSON at all (FastAPI's remapped 422)."""
        return cls(400, openai_error_body(message, "Bad Request", 400), message, sse=False)

    def sse_event(self) -> dict[str, Any]:
        """The `data:` payload SGLang 0.5.23 streams for this error."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "code": self.status,
                "retryable": False,
            }
        }
