"""Dynamic Gradient Gating: the z-score test, window filling, k = 1 exemption, statistic dg."""

import math

import pytest

from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate


def _feed(gate, energies, k=1):
    for e in energies:
        gate.update(gate.decide(e, k))


def test_no_verdict_until_window_full_then_z_by_hand():
    gate = DynamicGradientGate(DGGConfig(window=4, tau=0.5))
    for e in (1.0, 2.0, 3.0):
        d = gate.decide(100.0, 2)
        assert not d.gate and d.z is None
        gate.update(gate.decide(e, 1))
    gate.update(gate.decide(4.0, 1))
    d = gate.decide(5.0, 2)
    std = math.sqrt(sum((x - 2.5) ** 2 for x in (1, 2, 3, 4)) / 3)
    assert d.z == pytest.approx((5.0 - 2.5) / std)
    assert d.gate  # z = 1.94 > 0.5
    assert not gate.decide(2.6, 2).gate  # z = 0.08


def test_never_gates_first_pass_and_gated_values_stay_out_of_window():
    gate = DynamicGradientGate(DGGConfig(window=3, tau=0.1))
    _feed(gate, [1.0, 1.1, 0.9])
    spike = gate.decide(50.0, 1)
    assert spike.z > 10 and not spike.gate
    gated = gate.decide(50.0, 2)
    assert gated.gate
    before = gate.state_dict()
    gate.update(gated)
    assert gate.state_dict() == before


def test_dg_statistic_uses_increments():
    gate = DynamicGradientGate(DGGConfig(window=2, statistic="dg", tau=0.5))
    _feed(gate, [1.0, 2.0, 3.5])  # increments 1.0, 1.5 fill the window
    d = gate.decide(10.0, 2)  # increment 6.5
    assert d.stat == pytest.approx(6.5)
    assert d.z == pytest.approx((6.5 - 1.25) / math.sqrt(0.125))
    assert d.gate


def test_disabled_gate_logs_but_never_gates():
    gate = DynamicGradientGate(DGGConfig(window=2, enabled=False))
    _feed(gate, [1.0, 1.1])
    d = gate.decide(1e9, 3)
    assert d.z > 1e6 and not d.gate


def test_state_round_trip_and_config_errors():
    gate = DynamicGradientGate(DGGConfig(window=2))
    _feed(gate, [1.0, 2.0])
    other = DynamicGradientGate(DGGConfig(window=2))
    other.load_state_dict(gate.state_dict())
    assert other.decide(7.0, 2) == gate.decide(7.0, 2)
    for kwargs, field in [
        ({"window": 1}, "window"),
        ({"statistic": "norm"}, "statistic"),
    ]:
        with pytest.raises(ValueError, match=field):
            DGGConfig(**kwargs)
    with pytest.raises(ValueError, match="reuse_index"):
        gate.decide(1.0, 0)
