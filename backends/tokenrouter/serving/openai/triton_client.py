"""The Triton side: the `tokenrouter` model's input tensors and `TritonGrpcBackend`, which runs each
request on its own tritonclient gRPC stream (clients pooled).

Each HTTP request gets its own gRPC stream because Triton's stream API can only cancel a whole stream:
when the HTTP client goes away, `stop_stream(cancel_requests=True)` cancels the RPC and the server
aborts exactly that generation.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from tokenrouter.serving.openai.errors import ClientDisconnected, TritonRequestError
from tokenrouter.serving.openai.responses import TritonChunk, chunk_from_infer_result

logger = logging.getLogger(__name__)

DEFAULT_TRITON_MODEL = "tokenrouter"


def triton_input_arrays(prompt: str, sampling: Mapping[str, Any], stream: bool) -> dict[str, np.ndarray]:
    """The `tokenrouter` model's input tensors (all dims [1]; the model does not batch in Triton).

    The prompt is never echoed (`exclude_input_in_output`) since OpenAI's echo is unsupported, and the
    optional outputs are always requested because usage and the `routing` extension need them.
    """
    return {
        "text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
        "stream": np.array([stream], dtype=np.bool_),
        "sampling_parameters": np.array([json.dumps(dict(sampling)).encode("utf-8")], dtype=np.object_),
        "exclude_input_in_output": np.array([True], dtype=np.bool_),
        "return_num_output_tokens": np.array([True], dtype=np.bool_),
        "return_finish_reason": np.array([True], dtype=np.bool_),
        "return_routing_stats": np.array([True], dtype=np.bool_),
    }


def make_grpc_inputs(arrays: Mapping[str, np.ndarray]) -> list[Any]:
    """tritonclient.grpc `InferInput`s for `triton_input_arrays` output."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in arrays.items():
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


class GenerationStream(Protocol):
    """What the HTTP layer needs from one in-flight Triton request (a fake can stand in for tests)."""

    def chunks(self) -> Iterator[TritonChunk]: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    def is_ready(self) -> bool: ...

    def open_stream(
        self, arrays: Mapping[str, np.ndarray], request_id: str, should_cancel: Callable[[], bool] | None = None
    ) -> GenerationStream: ...

    def close(self) -> None: ...


class TritonStream:
    """One request on its own tritonclient gRPC stream.

    The stream callback runs on tritonclient's reader thread and only enqueues; everything else
    (including `stop_stream`, which joins that thread) happens on the HTTP handler's thread.
    """

    def __init__(
        self,
        backend: TritonGrpcBackend,
        client: Any,
        arrays: Mapping[str, np.ndarray],
        request_id: str,
        should_cancel: Callable[[], bool] | None,
        poll_interval: float,
    ) -> None:
        self._backend = backend
        self._client = client
        self._queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._should_cancel = should_cancel
        self._poll_interval = poll_interval
        self._done = False  # the final response (or an error) has arrived
        self._clean = False  # ...and it was a final response, so the stream can be closed gracefully
        self._closed = False
        self.request_id = request_id
        client.start_stream(callback=self._on_response)
        try:
            client.async_stream_infer(
                backend.model_name,
                make_grpc_inputs(arrays),
                request_id=request_id,
                # A model may end with a flags-only response; without this Triton would not send it
                # and we could never tell the request finished.
                enable_empty_final_response=True,
            )
        except Exception as e:
            # The caller (open_stream) releases the client; only the half-open stream is ours to end.
            self._closed = True
            try:
                client.stop_stream(cancel_requests=True)  # joins the reader thread, so its error is queued
            except Exception:
                logger.debug("stop_stream after a failed send failed", exc_info=True)
            # tritonclient refuses to send on a broken stream with a generic message and reports the
            # actual cause (e.g. "failed to connect to all addresses") only through the callback.
            cause = e
            while not self._queue.empty():
                _, error = self._queue.get_nowait()
                cause = error if error is not None else cause
            raise _triton_error(cause) from None

    def _on_response(self, result: Any, error: Any) -> None:
        self._queue.put((result, error))

    def chunks(self) -> Iterator[TritonChunk]:
        """Decoded responses up to and including the final one.

        Raises TritonRequestError for an error response and ClientDisconnected (after cancelling) when
        `should_cancel` says the HTTP client left; that check runs at least every `poll_interval` s.
        """
        last_poll = time.monotonic()
        while not self._done:
            try:
                result, error = self._queue.get(timeout=self._poll_interval)
            except queue.Empty:
                result = error = None
            now = time.monotonic()
            if self._should_cancel is not None and now - last_poll >= self._poll_interval:
                last_poll = now
                if self._should_cancel():
                    self.cancel()
                    raise ClientDisconnected(self.request_id)
            if result is None and error is None:
                continue
            if error is not None:
                self._done = True
                raise _triton_error(error)
            chunk = chunk_from_infer_result(result)
            if chunk.final:
                self._done = self._clean = True
            yield chunk

    def cancel(self) -> None:
        """Cancel the RPC; Triton then cancels the request and the model aborts the generation."""
        if self._closed:
            return
        self._closed = True
        self._done = True
        try:
            self._client.stop_stream(cancel_requests=True)
        except Exception:  # the stream may already be broken; cancelling is best effort
            logger.debug("stop_stream(cancel_requests=True) failed", exc_info=True)
        # After a cancel the client's stream state is not worth trusting: drop it, do not pool it.
        self._backend._release(self._client, reusable=False)

    def close(self) -> None:
        """Release the stream: gracefully after a final response, by cancellation otherwise."""
        if self._closed:
            return
        if not self._clean:
            self.cancel()
            return
        self._closed = True
        try:
            # Half-closes the request side; Triton ends the RPC since nothing is outstanding.
            self._client.stop_stream()
            reusable = True
        except Exception:
            logger.debug("stop_stream() failed", exc_info=True)
            reusable = False
        self._backend._release(self._client, reusable=reusable)

    def __enter__(self) -> TritonStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _triton_error(error: Any) -> TritonRequestError:
    """A tritonclient error (an `InferenceServerException`, which has message() and status()) or any other."""
    msg = error.message() if hasattr(error, "message") and callable(error.message) else str(error)
    status = error.status() if hasattr(error, "status") and callable(error.status) else None
    return TritonRequestError(msg or str(error), str(status) if status is not None else None)


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:
        logger.debug("closing a gRPC client failed", exc_info=True)


class TritonGrpcBackend:
    """Talks to the `tokenrouter` model over gRPC; keeps idle clients (channels) for reuse.

    A tritonclient `InferenceServerClient` holds at most one stream at a time, so concurrent requests
    each take their own client; idle ones are kept (up to `max_idle_clients`) to skip channel setup.
    """

    def __init__(
        self,
        url: str,
        model_name: str = DEFAULT_TRITON_MODEL,
        max_idle_clients: int = 16,
        poll_interval: float = 0.2,
    ) -> None:
        import tritonclient.grpc as grpcclient

        self._grpcclient = grpcclient
        self.url = url
        self.model_name = model_name
        self.poll_interval = poll_interval
        self._max_idle = max_idle_clients
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        # Unary health checks are thread-safe on a shared client; streams are not, hence the pool.
        self._health_client = grpcclient.InferenceServerClient(url=url)

    def _acquire(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._grpcclient.InferenceServerClient(url=self.url)

    def _release(self, client: Any, reusable: bool) -> None:
        if reusable:
            with self._lock:
                if len(self._idle) < self._max_idle:
                    self._idle.append(client)
                    return
        _close_quietly(client)

    def is_ready(self, timeout: float = 2.0) -> bool:
        try:
            return bool(self._health_client.is_model_ready(self.model_name, client_timeout=timeout))
        except Exception:
            return False

    def open_stream(
        self, arrays: Mapping[str, np.ndarray], request_id: str, should_cancel: Callable[[], bool] | None = None
    ) -> TritonStream:
        client = self._acquire()
        try:
            return TritonStream(self, client, arrays, request_id, should_cancel, self.poll_interval)
        except Exception as e:
            self._release(client, reusable=False)
            if isinstance(e, TritonRequestError):
                raise
            raise _triton_error(e) from None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in [*idle, self._health_client]:
            _close_quietly(c)
