"""SGLang 0.5.23's real `Sampler.forward` on CPU for tests/test_sglang_logprobs.py; run as a subprocess.

    python tests/sglang_sampler_worker.py PORT OUT_JSON

Each request's sampling settings are ours (`rollout.protocol.SamplingParams`, a per-request seed
as the trainer sends), turned into SGLang's by `sglang.wire.sampling_json`. The batch is built the
way the scheduler builds it: real `Req`s with SGLang's `SamplingParams` (normalised and verified,
which turns temperature 0 into top_k=1 at T=1), `SamplingBatchInfo.from_schedule_batch` on a real
`ScheduleBatch`, and a `LogitsProcessorOutput` carrying fixed fp32 logits. Run twice: with SGLang's
default environment, then with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which `layers/sampler.py` reads
once at import (so the module is reloaded after setting it). A subprocess for that, and because
the Sampler needs SGLang's parallel state (gloo, world size 1). Writes the logits, the drawn tokens
and the log-probs the Sampler wrote (`next_token_logprobs`, what becomes `output_token_logprobs`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sglang_cpu import require_sglang  # noqa: E402

VOCAB = 64
COPIES = 200  # rows per kind of request: enough draws to see the truncated support
KINDS = {  # our settings per kind of request (rollout.protocol.SamplingParams fields)
    "top_p": {"temperature": 0.7, "top_p": 0.9},
    "top_k": {"temperature": 1.3, "top_k": 5},
    "greedy": {"temperature": 0.0},
}


def sglang_params(kind: str, seed: int):
    """SGLang's SamplingParams for our request of this kind, as its tokenizer manager makes them."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sparserl_mcore.rollout.protocol import SamplingParams as Ours
    from sparserl_mcore.sglang.wire import sampling_json

    params = SamplingParams(**sampling_json(Ours(max_new_tokens=1, seed=seed, **KINDS[kind])))
    params.normalize(None)  # no stop strings: no tokenizer needed
    params.verify(VOCAB)
    return params


def run_sampler(kinds: list[str], logits_by_kind: dict[str, list[float]]) -> dict:
    """One `Sampler.forward` with return_logprob over COPIES rows of each kind."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import create_sampler
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    rows = [kind for kind in kinds for _ in range(COPIES)]
    reqs = [Req(f"r{i}", "", array("q", [1, 2, 3]), sglang_params(kind, i)) for i, kind in enumerate(rows)]
    info = SamplingBatchInfo.from_schedule_batch(ScheduleBatch(reqs=reqs, device="cpu"), VOCAB)
    logits = torch.tensor([logits_by_kind[kind] for kind in rows], dtype=torch.float32)
    out = LogitsProcessorOutput(next_token_logits=logits)
    tokens = create_sampler().forward(
        out, info, True, [0] * len(rows), [None] * len(rows), torch.zeros(len(rows), dtype=torch.int64)
    )
    return {
        "rows": rows,
        "tokens": tokens.tolist(),
        "logprobs": out.next_token_logprobs.tolist(),
        "temperatures": info.temperatures.view(-1).tolist(),
        "is_all_greedy": info.is_all_greedy,
        "seeds_used": info.sampling_seed is not None,
    }


def findings(logits_by_kind: dict[str, list[float]]) -> dict:
    """The sampler module's setting, and its output for a mixed and an all-greedy batch."""
    from sglang.srt.layers import sampler
    from sglang.srt.runtime_context import get_exec

    return {
        "backend": get_exec().kernel.sampling_backend,
        "return_original_logprob": sampler.SGLANG_RETURN_ORIGINAL_LOGPROB,
        "logits": logits_by_kind,
        "mixed": run_sampler(list(KINDS), logits_by_kind),
        "all_greedy": run_sampler(["greedy"], logits_by_kind),
    }


def main(port: int, out_json: Path) -> None:
    require_sglang()
    import torch
    from sglang.srt.layers import sampler
    from sglang_tp_worker import init_sglang_parallel, shutdown_sglang_parallel

    init_sglang_parallel(0, 1, port, sampling_backend="pytorch")  # SGLang's choice for device cpu
    torch.manual_seed(0)  # torch.multinomial in SGLang's pytorch sampling backend
    gen = torch.Generator().manual_seed(1234)
    logits_by_kind = {kind: (3.0 * torch.randn(VOCAB, generator=gen)).tolist() for kind in KINDS}
    found = {"default": findings(logits_by_kind)}  # the environment as the test left it (unset)
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    importlib.reload(sampler)  # the module reads it at import, as a server started with it set
    found["original"] = findings(logits_by_kind)
    shutdown_sglang_parallel()
    out_json.write_text(json.dumps(found))


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
