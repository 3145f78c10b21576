"""`RemoteEngine`: the `RolloutEngine` protocol over HTTP, talking to `sparserl serve`.

Failures surface as `RemoteEngineError` (a RuntimeError) naming the URL, the route and the cause,
after a bounded number of retries for transport errors and 5xx answers; 4xx answers (a bad
request, a wrong token) are raised at once, since repeating them cannot help. The trainer's
`EnginePool` reacts by moving the work to another engine. HTTP 400 is the server's ValueError
(e.g. a patch that fails verification) and 409 an outdated weight version, so both are raised as
`RemoteValueError`, which is also a ValueError: callers that fall back to a full sync on
ValueError in-process do the same remotely. A 503 (server full) is retried, no sooner than its
Retry-After.

Retrying /generate after a transport error can run a request twice on the server; the results of
the first attempt are discarded, so the trainer still sees exactly one sample per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import torch

from sparserl_mcore.rollout.http.wire import generate_body, read_sample
from sparserl_mcore.rollout.protocol import GenerateRequest, PauseMode, Sample


class RemoteEngineError(RuntimeError):
    """A remote engine did not do what was asked (after retries where retrying makes sense)."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RemoteValueError(RemoteEngineError, ValueError):
    """The server rejected the input (HTTP 400, or 409 for an outdated weight version): what an
    in-process engine raises as ValueError (WeightVersionConflict is one)."""


class RemoteEngine:
    """A rollout engine behind `sparserl serve` (or any server with the same routes).

    timeout: seconds one HTTP call may take (generation of a whole batch included).
    retries: extra attempts after a transport error or a 5xx answer, with `backoff_s` doubling.
    bucket_bytes: a full `update_weights` is sent as safetensors requests of at most about this
    size, so neither side holds a second copy of a large model in memory.
    max_connections: HTTP connections open at once (calls beyond wait for one, within `timeout`).
    concurrency: `generate` calls the `EnginePool` makes at once (chunks in flight), so the server
    batches them; each holds a connection, so it raises max_connections to at least itself.
    routed_experts_shape: the model's (layers, top_k) for an MoE policy, the shape routed experts
    are read back in (requests with `return_routed_experts`); None for a dense one.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        bucket_bytes: int = 512 * 2**20,
        max_connections: int = 100,
        concurrency: int = 1,
        routed_experts_shape: tuple[int, int] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url={url!r}: must start with http:// or https://")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"timeout={timeout}, connect_timeout={connect_timeout}: must be > 0 seconds")
        if retries < 0:
            raise ValueError(f"retries={retries}: must be >= 0")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}: must be >= 1 (chunks in flight)")
        self.concurrency = concurrency
        self.routed_experts_shape = routed_experts_shape
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.bucket_bytes = bucket_bytes
        self.last_pause_ms: float | None = None  # from the last /continue_generation answer
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max(max_connections, concurrency)),
        )

    def __repr__(self) -> str:
        return f"RemoteEngine({self.url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RolloutEngine -----------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        if not requests:
            return []
        answer = self._call("POST", "/generate", json=self._generate_body(requests)).json()
        if not isinstance(answer, list) or len(answer) != len(requests):
            raise RemoteEngineError(
                f"{self.url}/generate: expected {len(requests)} results, got {answer!r:.200}"
            )
        try:
            return [self._read_sample(obj, req) for obj, req in zip(answer, requests, strict=True)]
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteEngineError(f"{self.url}/generate: malformed response ({exc!r})") from exc

    # The /generate dialect (SGLang's own differs in a few names: `sglang.client.SGLangWorker`).
    _generate_body: Callable[[Sequence[GenerateRequest]], dict[str, Any]] = staticmethod(generate_body)

    def _read_sample(self, obj: dict[str, Any], request: GenerateRequest) -> Sample:
        return read_sample(obj, request, self.routed_experts_shape)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Send HF-named tensors in buckets of about `bucket_bytes`, each a safetensors body.

        Not atomic across buckets: a generation that runs between two buckets sees a mix, so
        pause generation around the update if requests may be in flight (the trainer syncs
        between rollout phases).
        """
        from safetensors.torch import save

        for bucket in _buckets(state_dict, self.bucket_bytes):
            body = save({k: v.detach().cpu().contiguous() for k, v in bucket.items()})
            self._call(
                "POST",
                "/update_weights_from_safetensors",
                params={"weight_version": int(version)},
                content=body,
                headers={"Content-Type": "application/octet-stream"},
            )

    def apply_patch(self, patch_bytes: bytes) -> int:
        answer = self._call(
            "POST",
            "/update_weights_from_patch",
            content=bytes(patch_bytes),
            headers={"Content-Type": "application/octet-stream"},
        ).json()
        paused = answer.get("pause_ms")
        self.last_pause_ms = float(paused) if isinstance(paused, (int, float)) else None
        return int(answer["weight_version"])

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    def abort(self, rid: str) -> None:
        self._call("POST", "/abort_request", json={"rid": rid})

    def pause(self, mode: PauseMode = "in_place") -> None:
        self._call("POST", "/pause_generation", json={"mode": mode})

    def resume(self) -> None:
        """Continue generating; `last_pause_ms` then holds how long the server stood still."""
        answer = self._call("POST", "/continue_generation").json()
        paused = answer.get("paused_ms") if isinstance(answer, dict) else None
        self.last_pause_ms = float(paused) if isinstance(paused, (int, float)) else None

    def model_info(self) -> dict[str, Any]:
        return dict(self._call("GET", "/get_model_info").json())

    def health(self, timeout: float = 10.0) -> bool:
        """True when the server answers /health with 200 within `timeout` seconds (one attempt, no
        retries: the pool asks after a failed call and while probing a removed engine)."""
        try:
            return self._http.get("/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    # -- transport ---------------------------------------------------------------------------
    def _call(self, method: str, route: str, *, retries: int | None = None, **kwargs: Any) -> httpx.Response:
        """`retries` overrides the engine's for one route (0 where repeating the call is unsafe)."""
        last, retry_after = "", 0.0
        attempts = (self.retries if retries is None else retries) + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(max(self.backoff_s * 2 ** (attempt - 1), retry_after))
            try:
                response = self._http.request(method, route, **kwargs)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code < 400:
                return response
            last, retry_after = self._retryable(route, response)
        raise self._gave_up(route, attempts, last)

    def _retryable(self, route: str, response: httpx.Response) -> tuple[str, float]:
        """A failed answer: raised at once when it is 4xx, else (the error, its Retry-After)."""
        detail, code = _detail(response), response.status_code
        if code < 500:
            kind = RemoteValueError if code in (400, 409) else RemoteEngineError
            raise kind(f"{self.url}{route}: HTTP {code}: {detail}", status_code=code)
        return f"HTTP {code}: {detail}", _retry_after(response)

    def _gave_up(self, route: str, attempts: int, last: str) -> RemoteEngineError:
        return RemoteEngineError(f"{self.url}{route}: failed after {attempts} attempts; last error {last}")


def _buckets(state: Mapping[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `limit` bytes (a larger tensor goes alone)."""
    buckets: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > limit:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += nbytes
    return buckets


def _retry_after(response: httpx.Response) -> float:
    """Seconds a 503 asks the client to wait (Retry-After in seconds; at most a minute)."""
    try:
        return min(60.0, max(0.0, float(response.headers.get("retry-after", 0))))
    except ValueError:
        return 0.0


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        return str(body.get("error") or body.get("detail") or body)[:500]
    return str(body)[:500]
