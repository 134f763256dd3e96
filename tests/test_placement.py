"""``distserve.placement``: the Placement JSON round trip, its pydantic validation naming the field's path, and
how its batch caps reach the instances' scheduler configs (the JSON's, then `distserve serve`'s flags, then an
instance's own)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from distserve.cli.args import build_parser
from distserve.cli.serve import prefill_scheduler_config, serve_placement
from distserve.config import SchedulerConfig
from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement
from distserve.slo import SLO

FULL = Placement(
    prefill=(InstanceSpec(2, 1, node=0, threads=2, max_num_batched_tokens=512),),
    decode=(InstanceSpec(1, 2, node=1, pool="latency", max_num_seqs=8), InstanceSpec()),
    predicted={"rate": 1.5}, slo=SLO(0.25, math.inf, 0.9), max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=1024,
)


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    FULL.to_json(path)
    data = json.loads(path.read_text())
    assert (data["max_model_len"], data["max_num_seqs"], data["max_num_batched_tokens"]) == (4096, 32, 1024)
    assert data["prefill"][0] == {"tp": 2, "pp": 1, "node": 0, "threads": 2, "max_num_batched_tokens": 512}
    assert data["decode"][1] == {"tp": 1, "pp": 1}  # unset keys are not written
    back = Placement.load(path)
    assert back == FULL and back.slo == FULL.slo and back.predicted == FULL.predicted
    bare = Placement.from_dict({"colocated": [{}]})
    assert bare.to_dict() == {"prefill": [], "decode": [], "colocated": [{"tp": 1, "pp": 1}]}  # no caps: none written


@pytest.mark.parametrize("data, where, param", [
    ({"colocated": [{"tp": 1, "gpus": 2}]}, "colocated[0].gpus: unknown key", "gpus"),
    ({"colocated": [{}], "max_num_seq": 8}, "placement max_num_seq: unknown key", "max_num_seq"),
    ({"colocated": [{"tp": "2"}]}, "colocated[0].tp", "tp"),
    ({"colocated": [{"tp": 0}]}, "colocated[0].tp", "tp"),
    ({"prefill": [{}], "decode": [{}, {"max_num_batched_tokens": -1}]}, "decode[1].max_num_batched_tokens", "max_num_batched_tokens"),
    ({"prefill": [{}], "decode": [{"max_num_seqs": True}]}, "decode[0].max_num_seqs", "max_num_seqs"),
    ({"prefill": [{}], "decode": [{"pool": "fast"}]}, "decode[0].pool", "pool"),
    ({"colocated": [{}], "max_num_seqs": 0}, "placement max_num_seqs", "max_num_seqs"),
    ({"colocated": [{}], "max_model_len": 2.5}, "placement max_model_len", "max_model_len"),
    ({"colocated": [{}], "slo": {"ttft_s": 1}}, "slo.tpot_s", "tpot_s"),
    ({"colocated": [{}], "slo": {"ttft_s": -1, "tpot_s": 1}}, "placement slo", "slo"),
    ({"colocated": {"tp": 1}}, "placement colocated", "colocated"),
    ({"prefill": [{}]}, "at least one prefill and one decode", None),
])
def test_a_bad_field_is_refused_naming_its_path(data: dict[str, Any], where: str, param: str | None) -> None:
    with pytest.raises(InvalidConfigError, match=where.replace("[", r"\[").replace("]", r"\]")) as exc:
        Placement.from_dict(data)
    assert exc.value.param == param


def test_constructing_in_python_validates_the_same_way() -> None:
    with pytest.raises(InvalidConfigError, match="instance max_num_batched_tokens") as exc:
        InstanceSpec(max_num_batched_tokens=0)
    assert exc.value.param == "max_num_batched_tokens"
    with pytest.raises(InvalidConfigError, match="instance tp"):
        InstanceSpec(tp=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="max_model_len"):
        Placement(colocated=(InstanceSpec(),), max_model_len=0)
    with pytest.raises(InvalidConfigError, match="only decode"):
        Placement(prefill=(InstanceSpec(pool="latency"),), decode=(InstanceSpec(),))
    with pytest.raises(InvalidConfigError, match="unknown placement caps"):
        FULL.with_caps(max_num_seq=3)


def test_caps_apply_placement_wide_then_per_instance() -> None:
    base = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    deployed = FULL.scheduler_config(base)
    assert (deployed.max_num_seqs, deployed.max_num_batched_tokens, deployed.max_model_len) == (32, 1024, 4096)
    assert FULL.decode[0].scheduler_config(deployed).max_num_seqs == 8  # the latency pool's own cap
    assert FULL.decode[1].scheduler_config(deployed).max_num_seqs == 32
    assert FULL.prefill[0].scheduler_config(deployed).max_num_batched_tokens == 512
    assert Placement.colocated_instances(1).scheduler_config(base) is base


def test_serve_flags_override_the_jsons_caps(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    FULL.to_json(path)
    args = build_parser().parse_args(["serve", "--placement", str(path)])
    assert serve_placement(args) == FULL
    args = build_parser().parse_args(["serve", "--placement", str(path), "--max-num-seqs", "16", "--max-model-len", "2k",
                                      "--max-num-batched-tokens", "4K"])
    placement = serve_placement(args)
    assert (placement.max_num_seqs, placement.max_model_len, placement.max_num_batched_tokens) == (16, 2000, 4096)
    assert placement.decode[0].scheduler_config(placement.scheduler_config(SchedulerConfig())).max_num_seqs == 8
    prefill = prefill_scheduler_config(args, placement)
    assert prefill.max_num_batched_tokens == 4096 and prefill.max_model_len == 2000
    chunked = build_parser().parse_args(["serve", "--placement", str(path), "--prefill-chunk", "256"])
    assert prefill_scheduler_config(chunked, serve_placement(chunked)).max_num_batched_tokens == 256
