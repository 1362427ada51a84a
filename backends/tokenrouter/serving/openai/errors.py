"""The front end's errors and how they reach the HTTP client: OpenAI-style error bodies and the HTTP status
that a Triton error maps to."""

from __future__ import annotations

from typing import Any

from tokenrouter.serving.tensors import TIMEOUT_ERROR

# Triton's gRPC stream drops the status code of an error response and keeps only its message, so
# bad input has to be recognised by wording. These cover the model's request parsing
# (serving/tensors.py), the engine's ValueError messages (tests/test_bad_input.py) and Triton core's
# own input checks.
BAD_INPUT_MARKERS = (
    "invalid",
    "not valid",
    "must be",
    "missing required input",
    "prompt is empty",
    "out of the vocabulary",
    "context limit",
    "is not an integer",
    "unknown sampling parameter",
    "sampling_parameters",
    "unexpected inference input",
    "unexpected shape",
    "unexpected datatype",
    "bad request",
    "bad input",
)
_BAD_INPUT_STATUSES = {"StatusCode.INVALID_ARGUMENT", "INVALID_ARG", "400"}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI answers for a missing or wrong key
    404: "invalid_request_error",
    405: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class OpenAIError(Exception):
    """An error to report to the HTTP client as an OpenAI-style error body with `status`."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, _ERROR_TYPES.get(self.status, "server_error"), self.param, self.code)


class TritonRequestError(Exception):
    """Triton answered the request with an error (or the stream to it broke)."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class ClientDisconnected(Exception):
    """The HTTP client went away while its generation was still running."""


def error_body(
    message: str, err_type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON body OpenAI returns for errors; clients (the `openai` package among them) parse this shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# gRPC's status when the Triton server cannot be reached (down, restarting, wrong address).
_UNREACHABLE_STATUSES = {"StatusCode.UNAVAILABLE"}
# The router's refusal while a model is down ("model 'large' is unavailable: ... retry shortly"), a request that
# a model's process took with it ("model 'large' went away during the request (...)": the router revives the
# model, so a retry is served or refused as above) and the server stopping: each may succeed when retried.
_UNAVAILABLE_MARKERS = ("is unavailable", "went away during the request", "the server is shutting down")
UNREACHABLE_MESSAGE = "the inference server is unavailable; retry shortly"


def triton_error_status(message: str, status: str | None = None) -> int:
    """HTTP status for a Triton error: 400 when it reports bad input, 503 when the server or one of its models
    is unavailable (a client or load balancer may retry, or go elsewhere), 504 when the deployment's
    request_timeout_s cut the request off, else 500."""
    if status in _BAD_INPUT_STATUSES:
        return 400
    if status in _UNREACHABLE_STATUSES or any(marker in message for marker in _UNAVAILABLE_MARKERS):
        return 503
    if TIMEOUT_ERROR in message:
        return 504
    lowered = message.lower()
    return 400 if any(marker in lowered for marker in BAD_INPUT_MARKERS) else 500


def to_openai_error(err: OpenAIError | TritonRequestError) -> OpenAIError:
    """The error to report for `err`: itself, or for a Triton error the status its message calls for. A server
    that cannot be reached is said so in one sentence: gRPC's own message names the channel's addresses and
    resolver, which are the operator's business (the front end logs them), not the client's."""
    if isinstance(err, OpenAIError):
        return err
    if err.status in _UNREACHABLE_STATUSES:
        return OpenAIError(UNREACHABLE_MESSAGE, 503)
    return OpenAIError(err.message or "inference failed", triton_error_status(err.message, err.status))
