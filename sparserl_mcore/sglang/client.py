"""Trainer-side client of SGLang workers' weight and pause routes (sglang 0.5.23), and of the router.

The router (sglang-router 0.3.2, `python -m sglang_router.launch_router`) proxies generation but
not the weight or pause routes (404 there), so every learner rank that sends fragments talks to
every worker directly, and the host's engine pool sends /generate to the router alone
(`SGLangRouter`, `rollout.router_url`). `router_workers` reads the worker URLs from the router's
`GET /workers` (`{"workers": [{"id", "url", ...}, ...], "total", "stats"}`); `DELETE
/workers/{id}` takes one out and `POST /workers` `{"url"}` puts one in (both answered 202 and done
in the background; an added worker is listed once the router's own `/health` of it passed).

Route shapes (sglang 0.5.23 `srt/entrypoints/http_server.py`, bodies from `srt/managers/io_struct.py`):
`POST /pause_generation` {"mode"}, `/continue_generation`, `/flush_cache`, `/begin_weight_update`
{"selector"}, `/end_weight_update`, `/update_weights_from_tensor` {"serialized_named_tensors",
"load_format", "flush_cache", "weight_version"}, `/init_weights_update_group` {"master_address",
"master_port", "rank_offset", "world_size", "group_name", "backend"},
`/destroy_weights_update_group` {"group_name"}, `/update_weights_from_distributed` {"names",
"dtypes", "shapes", "group_name", "flush_cache", "weight_version", "load_format"}. Failures answer
HTTP 400 with {"success": false, "message"}, raised as `RemoteValueError` (a ValueError: the trainer
then falls back to a full sync).
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import httpx
import torch

from sparserl_mcore.rollout.client import RemoteEngine, RemoteEngineError, RemoteValueError
from sparserl_mcore.rollout.protocol import GenerateRequest, RequestsFailed, Sample
from sparserl_mcore.sglang import wire
from sparserl_mcore.sglang.loader import LOADER_PATH, PATCH_TENSOR, VERSION_TENSOR

ROUTING_KEY_HEADER = "x-smg-routing-key"
DUPLICATE_RID = "Duplicate request ID"  # sglang 0.5.23 `TokenizerManager`: an id still registered


def _payload(named: list[tuple[str, torch.Tensor]]) -> str:
    """One TP rank's `serialized_named_tensors` entry: a plain pickle of CPU tensors (what SGLang's
    `SafeUnpickler` admits: `torch._utils._rebuild_tensor_v2` + `torch.storage._load_from_bytes`),
    base64 for the JSON body."""
    buf = io.BytesIO()
    pickle.dump(named, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(buf.getvalue()).decode()


def patch_payloads(fragments_by_rank: Sequence[bytes]) -> list[str]:
    """`serialized_named_tensors` carrying fragment r to TP rank r."""
    return [
        _payload([(PATCH_TENSOR, torch.frombuffer(bytearray(f), dtype=torch.uint8))])
        for f in fragments_by_rank
    ]


def version_payloads(version: int, tp_size: int) -> list[str]:
    """Tell every TP rank it now holds `version` (after a dense NCCL sync)."""
    return [_payload([(VERSION_TENSOR, torch.tensor([version], dtype=torch.int64))])] * tp_size


class SGLangWorker(RemoteEngine):
    """One SGLang server: generation through `RemoteEngine` in SGLang's /generate dialect
    (`sglang.wire`), plus the weight-update routes."""

    # set by in-flight weight syncs: requests carry it as `extra_key`, so none matches prefix KV an
    # older version cached (SGLang cannot flush while paused requests hold their pages)
    prefix_key: str | None = None

    def __repr__(self) -> str:
        return f"SGLangWorker({self.url!r})"

    def _generate_body(self, requests: Sequence[GenerateRequest]) -> dict[str, Any]:
        return wire.generate_body(requests, self.prefix_key)

    def _read_sample(self, obj: dict[str, Any], request: GenerateRequest) -> Sample:
        return wire.read_sample(obj, request, self.routed_experts_shape)

    def server_info(self) -> dict[str, Any]:
        return dict(self._call("GET", "/server_info").json())

    def tp_size(self) -> int:
        return int(self.server_info().get("tp_size", 1))

    def layout_sizes(self) -> tuple[int, int]:
        """(tp_size, ep_size): what its parameters are split by (`SGLangLayout`); SGLang's
        /server_info names its launch settings, `ep_size` among them (1 when absent)."""
        info = self.server_info()
        return int(info.get("tp_size", 1)), int(info.get("ep_size") or 1)

    def pause(self, mode: str = "retract") -> None:
        self._call("POST", "/pause_generation", json={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", json={})

    def begin_weight_update(self) -> None:
        self._call("POST", "/begin_weight_update", json={"selector": "all"})

    def end_weight_update(self) -> None:
        self._call("POST", "/end_weight_update", json={})

    def open_update_session(self, pause_mode: str = "retract") -> None:
        """Pause generation and begin a weight-update session. "retract": running requests restart
        from their prompts under the new weights; "in_place" (in-flight updates): they keep their KV
        and continue under the new weights.

        0.5.23 refuses a second session (`SchedulerWeightUpdaterManager.begin_weight_update`: "a
        weight-update session is already open"): one left by a trainer that died mid-sync is ended
        first (the run resumes with a full sync, so closing it loses nothing)."""
        self.pause(pause_mode)
        try:
            self.begin_weight_update()
        except RemoteValueError as exc:
            if "already open" not in str(exc):
                raise
            self.end_weight_update()
            self.begin_weight_update()

    def close_update_session(self, *, flush: bool = True, keep_paused: bool = False) -> None:
        """End the session, flush the radix cache (its KV came from the old weights), continue
        generation: each tried even when an earlier one failed, so a worker never stays paused by
        accident; raises RuntimeError naming every step that failed. `flush=False` after an
        in-place pause: 0.5.23 refuses a flush while requests hold pages (`Scheduler.flush_cache`:
        not idle); `prefix_key` keeps the versions' prefixes apart instead. `keep_paused`: the
        worker failed the update and may hold part of it; it stays paused for the fallback."""
        steps = [("end_weight_update", self.end_weight_update)]
        steps += [("flush_cache", self.flush_cache)] if flush else []
        steps += [] if keep_paused else [("continue_generation", self.resume)]
        problems = []
        for what, call in steps:
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the next step must still run
                problems.append(f"{what}: {type(exc).__name__}: {exc}")
        if problems:
            raise RuntimeError("; ".join(problems))

    def send_fragments(self, fragments_by_rank: Sequence[bytes], version: int) -> None:
        """This learner rank's fragments, one per TP rank of the worker (inside a begin/end session)."""
        self._update_from_tensor(patch_payloads(fragments_by_rank), version)

    def declare_version(self, version: int, tp_size: int) -> None:
        self._update_from_tensor(version_payloads(version, tp_size), version)

    def _update_from_tensor(self, payloads: list[str], version: int) -> None:
        body = {
            "serialized_named_tensors": payloads,
            "load_format": LOADER_PATH,
            "flush_cache": False,  # flushed once per sync, after the last fragment
            "weight_version": str(version),
        }
        self._call("POST", "/update_weights_from_tensor", json=body)

    def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str = "nccl",
    ) -> None:  # fmt: skip
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._call("POST", "/init_weights_update_group", json=body, retries=0)  # joins a rendezvous

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("POST", "/destroy_weights_update_group", json={"group_name": group_name})

    def update_weights_from_distributed(
        self, tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], *, group_name: str, version: int
    ) -> None:
        """Announce one bucket, which the sender broadcasts while this call waits (`flattened_bucket`:
        one flat uint8 tensor). Never retried: a second call would wait for a second broadcast."""
        body = {
            "names": [n for n, _, _ in tensors],
            "dtypes": [str(d).removeprefix("torch.") for _, d, _ in tensors],
            "shapes": [list(s) for _, _, s in tensors],
            "group_name": group_name,
            "flush_cache": False,
            "weight_version": str(version),
            "load_format": "flattened_bucket",
        }
        self._call("POST", "/update_weights_from_distributed", json=body, retries=0)  # joins a broadcast


class SGLangRouter(RemoteEngine):
    """Generation through sglang-router: ONE engine of the pool in front of all the workers.

    The router's /generate takes one prompt per call (it refuses a batch body: "Failed to
    deserialize the JSON body"), so a chunk goes out as one call per request, all at once, and
    the pool gives the router `concurrency` chunks at once (the workers' groups in flight,
    summed: as many as without a router). Those calls (up to every worker's
    `rollout.server_concurrency` together) run on one asyncio loop in a thread of its own, not a
    thread each, so the learner's host process does not carry thousands of threads competing for
    its GIL beside training. A failed call (transport error, 5xx: a worker that died under it, a
    502 / 503 from the router) is sent again, `retries` times at most, after `backoff_s`
    (doubling, no sooner than a Retry-After), with the same request id and seed: the router then
    picks a live worker. One request failing never cancels the others: what still fails after its
    retries comes back as `RequestsFailed` with every other request's sample, so the pool retries
    only the chunks holding a failed request. Before a request goes out again, an attempt of it
    that got no answer is cancelled and aborted on the workers (`_generate_one`), so the retry
    does not collide with it under the same id. The router forwards generation only, so `pause` /
    `resume` (a stop aborting what runs) go to `workers`, the servers behind it.

    A request's `routing_key` (a multi-turn episode group's) goes out as the `x-smg-routing-key`
    header. Under the router's `manual` policy (`--policy manual`; sglang-router 0.3.2's binary
    names the header `smg::routers::header_utils::HEADER_ROUTING_KEY`, the policy
    `policies/manual.rs`; tests/test_sglang_router.py measures it) a key's first request is
    assigned a worker (`--assignment-mode`: random by default) and every later request with the
    key goes to that worker while it is healthy, so each turn finds the previous ones in that
    worker's radix cache; a request without a key, or any request under another policy, is routed
    as the policy routes it.
    """

    prefix_key: str | None = None  # as SGLangWorker's; the router forwards `extra_key`

    def __init__(
        self,
        url: str,
        *,
        concurrency: int,
        chunk_size: int,
        timeout: float = 600.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        workers: Sequence[RemoteEngine] = (),
    ) -> None:
        self.workers = list(workers)
        super().__init__(url, timeout=timeout, retries=retries, backoff_s=backoff_s, concurrency=concurrency)
        self._async_http = httpx.AsyncClient(
            base_url=self.url,
            timeout=self._http.timeout,
            limits=httpx.Limits(max_connections=concurrency * chunk_size),
        )
        # both touched on the I/O loop only: the task sending each request id now, and the ids
        # sent without an answer since (an attempt of theirs may still run on a worker)
        self._sending: dict[str, asyncio.Task[Any] | None] = {}
        self._unanswered: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._io = threading.Thread(target=self._loop.run_forever, name="sglang-router-io", daemon=True)
        self._io.start()

    def __repr__(self) -> str:
        return f"SGLangRouter({self.url!r})"

    _read_sample = staticmethod(wire.read_sample)  # no routed experts: sglang-router drops the flag

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """One call per request on the I/O loop, each retried on its own; `RequestsFailed` when some
        still failed (the others' samples are in it)."""
        if not requests:
            return []
        return asyncio.run_coroutine_threadsafe(self._generate_all(requests), self._loop).result()

    async def _generate_all(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        outcomes = await asyncio.gather(*(self._generate_one(r) for r in requests), return_exceptions=True)
        if any(isinstance(o, BaseException) for o in outcomes):
            raise RequestsFailed(outcomes)
        return list(outcomes)  # type: ignore[arg-type]  # no exception among them

    async def _generate_one(self, request: GenerateRequest) -> Sample:
        """One request, retried under the same id. An earlier attempt of it that got no answer (a
        call the pool abandoned as hung, a timeout, a dropped connection) may still run on a
        worker, and SGLang refuses a second request with its id ("Duplicate request ID"): so that
        attempt's task is cancelled (it must not send the id again) and the id aborted on every
        worker first; a duplicate answer (SGLang drops an aborted id a scheduler step later) is
        retried like a 5xx."""
        body = wire.single_body(request, self.prefix_key)
        rid = str(body["rid"])
        earlier, self._sending[rid] = self._sending.get(rid), asyncio.current_task()
        if earlier is not None:
            earlier.cancel()
        headers = {ROUTING_KEY_HEADER: request.routing_key} if request.routing_key else None
        last, retry_after = "", 0.0
        try:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(max(self.backoff_s * 2 ** (attempt - 1), retry_after))
                if rid in self._unanswered:
                    await self._abort(rid)
                self._unanswered.add(rid)
                try:
                    response = await self._async_http.post("/generate", json=body, headers=headers)
                except httpx.TransportError as exc:
                    last, retry_after = f"{type(exc).__name__}: {exc}", 0.0
                    continue
                if response.status_code == 400 and DUPLICATE_RID in response.text:
                    last, retry_after = f"HTTP 400: {DUPLICATE_RID} {rid} (its abandoned attempt)", 0.0
                    continue
                self._unanswered.discard(rid)  # answered: no attempt of it runs any more
                if response.status_code >= 400:
                    last, retry_after = self._retryable("/generate", response)  # 4xx raises at once
                    continue
                try:
                    return self._read_sample(response.json(), request)
                except (KeyError, TypeError, ValueError) as exc:
                    raise RemoteEngineError(f"{self.url}/generate: malformed response ({exc!r})") from exc
            raise self._gave_up("/generate", self.retries + 1, last)
        finally:
            if self._sending.get(rid) is asyncio.current_task():
                del self._sending[rid]

    async def _abort(self, rid: str) -> None:
        """Abort `rid` on every worker (SGLang's `POST /abort_request`; sglang-router 0.3.2 does not
        forward it); best effort: a worker that cannot be asked is the prober's to take out."""
        await asyncio.gather(*(asyncio.to_thread(w.abort, rid) for w in self.workers), return_exceptions=True)

    def pause(self, mode: str = "retract") -> None:
        """Pause every worker behind the router (it does not forward the pause routes)."""
        for worker in self.workers:
            worker.pause(mode)  # type: ignore[arg-type]  # SGLang's modes, as SGLangWorker.pause

    def resume(self) -> None:
        for worker in self.workers:
            worker.resume()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._async_http.aclose(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._io.join(timeout=30)
            self._loop.close()
        super().close()

    def remove_workers(self, urls: Collection[str]) -> None:
        """Stop routing to these workers (dead ones, or ones the trainer could not sync: their
        weights are stale)."""
        listed = self._call("GET", "/workers").json().get("workers", [])
        for item in listed:
            if item.get("url") in urls:
                self._call("DELETE", f"/workers/{item['id']}")
        self.workers = [w for w in self.workers if w.url not in urls]

    def add_worker(self, worker: RemoteEngine, *, timeout_s: float = 120.0) -> None:
        """Route to `worker` again (one the pool re-admitted after a full sync); returns once the
        router lists it, raises RemoteEngineError when it does not within `timeout_s`."""
        self._call("POST", "/workers", json={"url": worker.url})
        deadline = time.monotonic() + timeout_s
        while worker.url not in router_workers(self.url):
            if time.monotonic() > deadline:
                raise RemoteEngineError(
                    f"{self.url}: {worker.url} not listed {timeout_s:g} s after POST /workers"
                )
            time.sleep(0.2)
        self.workers = [*(w for w in self.workers if w.url != worker.url), worker]


def router_workers(router_url: str, *, timeout: float = 10.0) -> list[str]:
    """Worker URLs the router serves, from its `GET /workers`: empty while it is still registering
    the workers it was started with (it does that in the background, after each one's /health)."""
    answer = httpx.get(router_url.rstrip("/") + "/workers", timeout=timeout)
    answer.raise_for_status()
    body = answer.json()
    items = body.get("workers") if isinstance(body, dict) else body
    if not isinstance(items, list):
        raise ValueError(f"{router_url}/workers: expected a list of workers, got {body!r:.200}")
    urls = [item if isinstance(item, str) else item.get("url") for item in items]
    if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
        raise ValueError(f"{router_url}/workers: expected a list of worker URLs, got {body!r:.200}")
    return urls


def weight_routes_refuse(url: str, token: str | None, *, timeout: float = 5.0) -> int | None:
    """The HTTP status (401 / 403) with which an SGLang worker refuses `token` on its weight routes,
    or None when it lets it through (or cannot be asked).

    One `POST /update_weights_from_tensor` with an empty JSON object: SGLang's auth middleware
    (`srt/utils/auth.py: decide_request_auth`, ADMIN_OPTIONAL) answers before the body is read, and
    a request it lets through is refused as malformed (`serialized_named_tensors` is required), so
    nothing is updated either way."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.post(
            url.rstrip("/") + "/update_weights_from_tensor", json={}, headers=headers, timeout=timeout
        )
    except httpx.HTTPError:
        return None
    return answer.status_code if answer.status_code in (401, 403) else None


def _server_info(url: str, token: str | None, timeout: float) -> tuple[int | None, Any]:
    """(HTTP status, JSON body or None) of one GET /server_info; (None, None) when unreachable."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(url.rstrip("/") + "/server_info", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None, None
    try:
        body = answer.json() if answer.status_code == 200 else None
    except ValueError:
        body = None
    return answer.status_code, body


def server_kind(url: str, token: str | None = None, *, timeout: float = 5.0) -> str | None:
    """ "sglang" or "sparserl" from one GET /server_info, None when the server does not say.

    SGLang answers a JSON object with its launch settings (`tp_size` among them); `sparserl serve`
    has no such route (404). Anything else (unreachable, still starting, a proxy's error) is
    left to the run itself: a dead server leaves the pool at its first call.
    """
    status, body = _server_info(url, token, timeout)
    if status == 404:
        return "sparserl"
    return "sglang" if isinstance(body, dict) and "tp_size" in body else None


def returns_routed_experts(url: str, token: str | None = None, *, timeout: float = 5.0) -> bool | None:
    """Whether an SGLang worker was started with `--enable-return-routed-experts` (its /server_info
    `enable_return_routed_experts`); None when it cannot be asked. Without it SGLang captures no
    routing and answers requests that ask for it without ids."""
    _, body = _server_info(url, token, timeout)
    if not isinstance(body, dict) or "enable_return_routed_experts" not in body:
        return None
    return body["enable_return_routed_experts"] is True


def overlap_scheduled(url: str, token: str | None = None, *, timeout: float = 5.0) -> bool:
    """Whether an SGLang worker runs its overlap scheduler (`disable_overlap_schedule` false in its
    /server_info; False when it says otherwise or cannot be asked).

    An in-place pause (`Scheduler.pause_generation` "in_place") leaves that scheduler's last
    launched batch unprocessed: the token it sampled with the old weights is appended after the
    update and reported under the new version (measured live: one token per running request and
    update), and on a GPU the update's writes can overlap that forward, which still reads the
    weights. KV compression turns the overlap scheduler off (`launch.sglang_argv`)."""
    _, body = _server_info(url, token, timeout)
    return isinstance(body, dict) and body.get("disable_overlap_schedule") is False
