"""The pure parts of serving one model across machines: the layer split, the hostfile, the
plan's checks (appliance/distributed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.distributed import plan
from appliance.distributed.hostfile import read
from appliance.distributed.split import Span, split_layers


def test_weights_split_in_proportion_to_the_budgets() -> None:
    # 350 bytes on equal budgets: 175 each, rank 0's counting the 50 of its head
    assert split_layers([10] * 30, 50, [200, 200]) in (
        [Span(0, 0, 12), Span(1, 12, 30)], [Span(0, 0, 13), Span(1, 13, 30)])
    # a machine with four times the budget takes four times the weights
    assert split_layers([10] * 30, 0, [400, 100]) == [Span(0, 0, 24), Span(1, 24, 30)]
    # the SmolLM-135M shape: a head of eight layers' bytes leaves rank 0 eleven layers
    assert split_layers([14] * 30, 113, [10**6, 10**6]) == [Span(0, 0, 11), Span(1, 11, 30)]


def test_every_machine_gets_a_layer_and_the_spans_cover_the_model() -> None:
    spans = split_layers([1] * 4, 0, [1000, 10, 10, 10])
    assert [s.hi - s.lo for s in spans] == [1, 1, 1, 1]
    assert spans[0].lo == 0 and spans[-1].hi == 4
    assert all(a.hi == b.lo for a, b in zip(spans, spans[1:], strict=False))


def test_a_model_too_big_for_the_machines_together_is_refused() -> None:
    with pytest.raises(ValueError, match="exceed the machines' memory budgets together"):
        split_layers([10 << 20] * 30, 50 << 20, [150 << 20, 150 << 20])


def test_a_split_that_leaves_one_machine_over_its_budget_is_refused() -> None:
    # together they fit, but rank 0 must also hold the head and the layers are big
    with pytest.raises(ValueError, match="machine 0 would hold 190 MiB of weights"):
        split_layers([100 << 20] * 2, 90 << 20, [150 << 20, 200 << 20])


def test_more_machines_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split over 3 machines"):
        split_layers([1, 1], 0, [10, 10, 10])


def test_the_hostfile_is_mlx_s_ring_format(tmp_path: Path) -> None:
    p = tmp_path / "hosts.json"
    p.write_text(json.dumps([["10.0.0.1:40000"], ["10.0.0.2:40000", "10.0.1.2:40000"]]))
    hf = read(p)
    assert hf.hosts == ("10.0.0.1", "10.0.0.2") and hf.size == 2


@pytest.mark.parametrize(("text", "message"), [
    ("[", "is not JSON"),
    ('[["10.0.0.1:40000"]]', "at least two"),
    ('{"hosts": []}', "at least two"),
    ('[["10.0.0.1"], ["10.0.0.2:1"]]', "rank 0 must list 'host:port'"),
    ('[["10.0.0.1:1"], [":x"]]', "is not host:port"),
])
def test_a_bad_hostfile_says_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "hosts.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=message):
        read(p)


def test_a_missing_hostfile_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the hostfile"):
        read(tmp_path / "none.json")


def test_a_plan_is_checked_for_its_step_and_checksum() -> None:
    ops = [["join", [3]], ["forward", 1, [[4, 0, 16]], [4]]]
    message = json.loads(json.dumps(plan.encode(ops, 7)))  # as it travels
    assert plan.decode(message, 7) == ops
    with pytest.raises(plan.PlanError, match="expected step 8"):
        plan.decode(message, 8)
    message["plan"]["ops"][1][1] = 2  # a row more than rank 0 planned
    with pytest.raises(plan.PlanError, match="fails its checksum"):
        plan.decode(message, 7)
    with pytest.raises(plan.PlanError, match="not a plan"):
        plan.decode({"ping": 1.0}, 7)
