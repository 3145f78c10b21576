"""DiLoCo islands and PULSELoCo (`sparserl_mcore.diloco`, `parallel/islands.py`).

In process: the BF16 visibility gate with error feedback and the payload codec.
One 4-rank gloo launch (tests/islands_worker.py) runs the layouts and writes what they did; the
tests here check it against independent references:
- 2 islands x TP=2: every outer step of `dense` and `pulse` equals, bit for bit, a single-process
  DiLoCo / PULSELoCo written here on the unsharded (HF) tensors, fed the islands' local weights;
  `pulse` with the gate forced open equals `dense` bit for bit; islands hold the same anchor;
- H=1, outer lr 1, momentum 0: the outer step lands on the mean of the islands' masters (Adam,
  masters sharded by the distributed optimizer), and with SGD it equals megatron's plain DDP;
- a training checkpoint taken mid round resumes bit-identically (masters, BF16 weights, Adam,
  anchor, residual, momentum, counters);
- the rollout engines receive bf16(anchor), not an island's local weights.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.diloco import payload
from sparserl_mcore.diloco.gate import bf16_bits, open_gate, pulse_gate
from sparserl_mcore.parallel.launch import launch_local
from sparserl_mcore.sync.hf_files import load_state
from sparserl_mcore.trainer.run_layout import RunLayout, resume_problem

WORKER = str(pathlib.Path(__file__).with_name("islands_worker.py"))
H, ROUNDS = 2, 2
OUTER_LR, MOMENTUM = 0.7, 0.9


# -- the gate ---------------------------------------------------------------------------------------
def _ulp_bf16(a: torch.Tensor) -> torch.Tensor:
    """The width of a value's BF16 cell (8 significant bits): 2^(e - 8) for a = m * 2^e, m in [0.5, 1)."""
    _, exponent = torch.frexp(a)
    return torch.ldexp(torch.ones_like(a), exponent - 8)


def test_gate_sends_nothing_below_a_bf16_cell_and_everything_above():
    anchor = torch.tensor([1.0, -0.75, 3.0e-3, 250.0, 1.0e-20])  # exact BF16 values: centred in no cell
    anchor = anchor.to(torch.bfloat16).float()
    ulp = _ulp_bf16(anchor)
    small = ulp * 0.2  # under half the narrower cell (below a power of two): a - s rounds back to a
    idx, values = pulse_gate(anchor, small.clone(), torch.zeros(5))
    assert idx.numel() == 0 and values.numel() == 0
    big = ulp * 1.5  # one and a half cells: another BF16 value
    residual = torch.zeros(5)
    idx, values = pulse_gate(anchor, big.clone(), residual)
    assert idx.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(values, big) and torch.equal(residual, torch.zeros(5))


def test_gate_conserves_s_exactly_and_a_held_back_residual_eventually_fires():
    gen = torch.Generator().manual_seed(1)
    anchor = torch.randn(50_000, generator=gen) * 0.02
    residual = torch.randn(50_000, generator=gen) * 1e-5
    delta = torch.randn(50_000, generator=gen) * 3e-5
    s = residual + delta
    idx, values = pulse_gate(anchor, delta, residual)
    sent = torch.zeros_like(s).index_put_((idx,), values)
    assert 0 < idx.numel() < s.numel()
    assert torch.equal((sent + residual).view(torch.int32), s.view(torch.int32))  # exact, bit for bit
    assert torch.equal(residual[idx], torch.zeros_like(values))  # fired entries fully consumed
    changed = bf16_bits(anchor) != bf16_bits(anchor - s)
    assert torch.equal(changed.nonzero().squeeze(1), idx)
    # a constant drift below one cell per round is held back, then fires within a few cells' worth
    a = torch.tensor([0.75])  # mid-binade: the same cell width on both sides
    drift = _ulp_bf16(a) * 0.3
    e, rounds = torch.zeros(1), 0
    while True:
        rounds += 1
        i, v = pulse_gate(a, drift.clone(), e)
        if i.numel():
            break
        assert rounds < 10
    assert rounds > 1 and torch.allclose(v, drift * rounds, rtol=1e-6) and e.item() == 0.0


def test_open_gate_sends_every_entry_and_keeps_no_residual():
    anchor, delta, residual = torch.ones(7), torch.full((7,), 1e-9), torch.full((7,), 2e-9)
    idx, values = open_gate(anchor, delta, residual)
    assert idx.tolist() == list(range(7)) and torch.equal(values, torch.full((7,), 1e-9) + 2e-9)
    assert not residual.any()


# -- the payload ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shard():
    """A realistic shard: log-normal weight magnitudes, a drift of a few 1e-5 per element."""
    gen = torch.Generator().manual_seed(2)
    anchor = torch.randn(400_000, generator=gen) * torch.exp(torch.randn(400_000, generator=gen)) * 0.02
    delta = torch.randn(400_000, generator=gen) * 4e-5
    idx, values = pulse_gate(anchor, delta, torch.zeros_like(anchor))
    base = bf16_bits(anchor).numpy().view(np.uint16)
    return idx.numpy(), values.numpy(), base


@pytest.mark.parametrize("level", [1, None])
def test_payload_round_trips_indices_and_fp32_values_exactly(shard, level):
    idx, values, base = shard
    blob = payload.encode(idx, values, base, level=level)
    got_idx, got_values = payload.decode(blob, base)
    order = np.argsort(got_idx)
    assert np.array_equal(got_idx[order], idx)
    assert np.array_equal(got_values[order].view(np.uint32), values.view(np.uint32))
    # the authors' wire is 12 bytes per entry (int64 index + FP32 value)
    assert len(blob) / idx.size < (6 if level is None else 4.5), len(blob) / idx.size


def test_payload_refuses_corruption_and_another_anchor(shard):
    idx, values, base = shard
    blob = bytearray(payload.encode(idx, values, base))
    blob[40] ^= 1
    with pytest.raises(payload.PayloadError, match="checksum"):
        payload.decode(bytes(blob), base)
    other = base.copy()
    other[: other.size // 2] ^= 0x0100  # exponent bits flipped: other magnitude classes
    with pytest.raises(payload.BaseMismatch, match="anchor"):
        payload.decode(payload.encode(idx, values, base), other)
    # checked per range: the receiver learns which range (the outer step's tensor) differs
    spans = [100_000, 150_000, 150_000]
    other = base.copy()
    other[300_000] ^= 1  # one element of the last range, one BF16 cell off
    with pytest.raises(payload.BaseMismatch) as mismatch:
        payload.decode(payload.encode(idx, values, base, spans=spans), other, spans=spans)
    assert mismatch.value.span == 2
    with pytest.raises(payload.PayloadError, match="checks 3 anchor ranges, this shard has 1"):
        payload.decode(payload.encode(idx, values, base, spans=spans), base)
    with pytest.raises(payload.PayloadError, match="elements"):
        payload.decode(payload.encode(idx, values, base), base[:-1])


def test_payload_of_nothing_sent(shard):
    _, _, base = shard
    got_idx, got_values = payload.decode(
        payload.encode(np.zeros(0, np.int64), np.zeros(0, np.float32), base), base
    )
    assert got_idx.size == got_values.size == 0


# -- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.islands=0", "parallel: islands=0: must be an integer >= 1"),
        ("diloco.inner_steps=0", "diloco: inner_steps=0: must be an integer >= 1"),
        ("diloco.mode=sparse", "diloco.mode: 'sparse' is not allowed; allowed values: pulse, dense"),
        ("diloco.outer_momentum=1.0", "diloco: outer_momentum=1.0: must be in [0, 1)"),
        ("diloco.zstd_level=0", "diloco: zstd_level=0: must be 1..22"),
    ],
)
def test_bad_island_settings_are_refused_naming_the_key(override, message):
    from sparserl_mcore.config import ConfigError, load_config_text

    base = "model: {hf_path: m}\ndata: {train_path: t}\n"
    assert load_config_text(base).parallel.islands == 1  # default: one island, as before
    with pytest.raises(ConfigError) as refused:
        load_config_text(base, [override])
    assert message in str(refused.value) and "\n" not in str(refused.value)


# -- layouts that cannot resume -----------------------------------------------------------------------
def _layout(**kw) -> RunLayout:
    base = dict(
        world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        params_dtype="bf16", distributed_optimizer=True, islands=2,
    )  # fmt: skip
    return RunLayout(**{**base, **kw})


def test_a_changed_island_count_or_layout_is_refused_in_one_line():
    problem = resume_problem(_layout(), _layout(islands=1), same_world_files=True)
    assert problem is not None and "\n" not in problem and "set parallel.islands=2" in problem
    problem = resume_problem(_layout(), _layout(world_size=8), same_world_files=True)
    assert problem is not None and "resume at the saved layout" in problem
    assert resume_problem(_layout(), _layout(), same_world_files=True) is None
    # a record from before islands existed loads as one island
    assert (
        RunLayout.from_dict({k: v for k, v in _layout(islands=1).to_dict().items() if k != "islands"}).islands
        == 1
    )


# -- the 4-rank launch ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("islands")
    hf = make_tiny(TinyModelConfig(vocab=100), root / "hf")
    gen = torch.Generator().manual_seed(3)
    plan = {
        "hf_dir": str(hf),
        "batches": torch.randint(0, 100, (2, 6, 2, 17), generator=gen).tolist(),  # island, step, rows
        "sgd_batches": torch.randint(0, 100, (3, 2, 17), generator=gen).tolist(),
    }
    (root / "plan.json").write_text(json.dumps(plan))
    launch_local([WORKER, str(root)], 4, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    return root


def _state(path: pathlib.Path) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in load_state(path).items()}


def _reference_round(anchor, locals_, residuals, momentum, *, mode: str):
    """One DiLoCo / PULSELoCo outer step on whole tensors, written independently of the package:
    torch.optim.SGD (Nesterov) on the anchor, the islands' sent entries summed in island order."""
    new_anchor, new_momentum = {}, {}
    for name, a in anchor.items():
        total = torch.zeros_like(a)
        for i, local in enumerate(locals_):
            delta = a - local[name]
            if mode == "dense":
                total = total + delta
                continue
            s = residuals[i][name] + delta
            fire = a.to(torch.bfloat16).view(torch.int16) != (a - s).to(torch.bfloat16).view(torch.int16)
            total = total + torch.where(fire, s, torch.zeros_like(s))
            residuals[i][name] = torch.where(fire, torch.zeros_like(s), s)
        p = torch.nn.Parameter(a.clone())
        sgd = torch.optim.SGD([p], lr=OUTER_LR, momentum=MOMENTUM, nesterov=True, foreach=False)
        if name in momentum:
            sgd.state[p]["momentum_buffer"] = momentum[name].clone()
        p.grad = total / len(locals_)
        sgd.step()
        new_anchor[name], new_momentum[name] = p.detach(), sgd.state[p]["momentum_buffer"]
    return new_anchor, new_momentum


@pytest.mark.parametrize("mode", ["dense", "pulse"])
def test_tp2_outer_steps_equal_a_single_process_reference_bitwise(work, mode):
    anchor = _state(work / "hf")
    residuals = [{n: torch.zeros_like(t) for n, t in anchor.items()} for _ in range(2)]
    momentum: dict[str, torch.Tensor] = {}
    run = work / "tp2" / mode
    for k in range(1, ROUNDS + 1):
        locals_ = [_state(run / f"island{i}" / f"local{k}") for i in range(2)]
        assert any(not torch.equal(locals_[0][n], locals_[1][n]) for n in anchor)  # islands trained apart
        anchor, momentum = _reference_round(anchor, locals_, residuals, momentum, mode=mode)
        for i in range(2):
            got = _state(run / f"island{i}" / f"anchor{k}")
            bad = [
                n for n in anchor if not torch.equal(got[n].view(torch.int32), anchor[n].view(torch.int32))
            ]
            assert not bad, f"round {k}, island {i}: {mode} anchor differs from the reference in {bad[:3]}"


def test_pulse_with_the_gate_forced_open_equals_dense_bitwise(work):
    stats = json.loads((work / "tp2" / "stats0.json").read_text())
    for k in range(1, ROUNDS + 1):
        dense, opened = (_state(work / "tp2" / run / "island0" / f"anchor{k}") for run in ("dense", "open"))
        assert all(torch.equal(dense[n].view(torch.int32), opened[n].view(torch.int32)) for n in dense), k
    pulse = _state(work / "tp2" / "pulse" / "island0" / f"anchor{ROUNDS}")
    assert any(not torch.equal(pulse[n], dense[n]) for n in dense)  # the real gate held entries back
    assert all(r["diloco/density"] == 1.0 for r in stats["open"])
    assert all(0.0 < r["diloco/density"] < 1.0 for r in stats["pulse"])
    assert all(r["diloco/bytes_per_entry"] < 12 for r in stats["pulse"])


def _diverged(work: pathlib.Path, fault: str) -> tuple[str | None, list[str | None]]:
    """(the tensor the fault hit, what each of the 4 ranks raised) in the `diverged` phase."""
    found = [json.loads((work / "diverged" / f"rank{r}.json").read_text())[fault] for r in range(4)]
    return found[2]["hit"], [f["raised"] for f in found]


@pytest.mark.parametrize(
    ("fault", "when", "what"),
    [
        ("dense/anchor", "after", "the FP32 anchor of {} differs"),
        ("pulse/anchor", "before", "the FP32 anchor of {} differs"),
        ("dense/weights", "after", "the bfloat16 weights of {} differ"),
        ("pulse/weights", "after", "the bfloat16 weights of {} differ"),
    ],
)
def test_a_diverged_island_stops_every_rank_with_one_line_naming_the_tensor_and_ranks(
    work, fault, when, what
):
    """Rank 2 (island 1) alone: an FP32 anchor element moved off between outer steps (pulse sees it
    in the payloads' anchor check, dense in the hash check after the step), or one BF16 weight
    element a cell off after the step's publish, the anchors equal."""
    hit, raised = _diverged(work, fault)
    assert hit is not None
    line = (
        f"IslandsDiverged: islands diverged {when} outer step 1: {what.format(hit)} "
        "between rank 0 (island 0) and rank 2 (island 1)"
    )
    assert raised == [line] * 4, raised


def test_a_payload_damaged_on_the_way_is_reported_as_such_on_every_rank(work):
    _, raised = _diverged(work, "pulse/payload")
    assert (
        raised
        == [
            "OuterStepFailed: outer step 1: rank 0 (island 0) cannot use the payload of rank 2 (island 1): "
            "payload checksum mismatch (truncated or corrupt)"
        ]
        * 4
    ), raised


def _ulps_off(got: torch.Tensor, want: torch.Tensor, *scales: torch.Tensor) -> float:
    """Largest |got - want| in FP32 ulps of the largest magnitude involved."""
    scale = torch.stack([got.abs(), *(s.abs() for s in scales)]).amax(0)
    ulp = (torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale).double()
    return float(((got.double() - want).abs() / ulp).max())


def test_h1_outer_lr1_momentum0_lands_on_the_mean_of_the_islands(work):
    steps = torch.load(work / "average.pt")
    previous = steps[0][1]
    for before, after in steps[1:]:
        for key, got in after.items():
            local = [before[f"island{i}/{key}"] for i in range(2)]
            assert not torch.equal(local[0], local[1])
            mean = (local[0].double() + local[1].double()) / 2
            # anchor - ((anchor - l0) + (anchor - l1)) / 2 in FP32: within an ulp of the exact mean
            assert _ulps_off(got, mean, previous[key], *local) <= 1.0, key
        previous = after


def test_h1_outer_lr1_momentum0_with_sgd_equals_plain_data_parallel(work):
    islands, ddp = torch.load(work / "sgd_islands.pt"), torch.load(work / "sgd_ddp.pt")
    start = None
    for k, (a, b) in enumerate(zip(islands, ddp, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.allclose(a[key], b[key], rtol=0, atol=1e-6), (k, key, (a[key] - b[key]).abs().max())
        start = start or b
    assert any(not torch.equal(start[key], ddp[-1][key]) for key in start)  # it trained


def test_resume_mid_round_is_bit_identical(work):
    for rank in range(4):
        found = torch.load(work / "resume" / f"rank{rank}.pt")
        straight, resumed = found["straight"], found["resumed"]
        assert found["rng_restored"] is True
        assert straight["counters"] == resumed["counters"] and straight["counters"]["outer_steps"] == 3
        for key in ("masters", "anchor", "residual", "momentum"):
            assert torch.equal(straight[key].view(torch.int32), resumed[key].view(torch.int32)), (rank, key)
        assert straight["residual"].any()  # pulse held something back
        for a, b in zip(straight["weights"], resumed["weights"], strict=True):
            assert torch.equal(a, b), rank
        for a, b in zip(straight["adam"], resumed["adam"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rank


def test_engines_get_the_agreed_weights_not_an_islands_own(work):
    found = torch.load(work / "sync" / "receiver.pt")
    init = {n: t.to(torch.bfloat16) for n, t in load_state(work / "hf").items()}
    agreed = load_state(work / "sync" / "island0" / "agreed")
    other = load_state(work / "sync" / "island1" / "agreed")
    local = load_state(work / "sync" / "island0" / "local")
    assert all(torch.equal(found["start"][n], init[n]) for n in init)
    assert found["version"] == 1 and 0 < found["patch_bytes"]
    assert all(torch.equal(agreed[n], other[n]) for n in agreed)
    assert all(torch.equal(found["synced"][n], agreed[n]) for n in agreed)
    assert any(not torch.equal(local[n], agreed[n]) for n in agreed)  # the island had moved on
