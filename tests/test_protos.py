"""The parity.v1 API: committed stubs are current, names are stable, buf style holds."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("parity.v1.RolloutService", "parity.v1.TrainerService", "parity.v1.WeightBroadcastService")
# Services that users implement (no GetStatus: Parity is their client); buf style holds for them too.
USER_SERVICES = ("parity.v1.RewardService",)


def test_regenerated_stubs_equal_committed(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.name for p in (tmp_path / "parity" / "v1").iterdir())
    committed = sorted(
        p.name for p in (ROOT / "parity" / "v1").iterdir() if p.name != "__init__.py" and p.is_file()
    )
    assert generated == committed
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "parity" / "v1", ROOT / "parity" / "v1", generated, shallow=False
    )
    assert not mismatch and not errors, f"stale stubs, run scripts/gen_protos.sh: {mismatch + errors}"


def _pool():
    from google.protobuf import descriptor_pool

    from parity.v1 import broadcast_pb2, reward_pb2, rollout_pb2, rollouts_pb2, trainer_pb2  # noqa: F401

    return descriptor_pool.Default()


@pytest.mark.parametrize("service", SERVICES)
def test_service_exists_with_get_status(service: str) -> None:
    descriptor = _pool().FindServiceByName(service)
    assert "GetStatus" in descriptor.methods_by_name


def test_generate_has_the_fixed_minimum_fields() -> None:
    from parity.v1 import common_pb2, rollout_pb2

    expected = {
        rollout_pb2.GenerateRequest: {"request_id", "prompt_text", "prompt_token_ids", "sampling"},
        common_pb2.SamplingParams: {"temperature", "top_p", "top_k", "max_tokens", "n", "seed", "stop"},
        rollout_pb2.GenerateResponse: {"prompt_token_ids", "completions"},
        rollout_pb2.Completion: {"token_ids", "logprobs", "token_weight_versions", "text", "finish_reason"},
    }
    for message, fields in expected.items():
        assert fields <= set(message.DESCRIPTOR.fields_by_name), message.DESCRIPTOR.full_name
    method = _pool().FindServiceByName("parity.v1.RolloutService").methods_by_name["Generate"]
    assert method.input_type.full_name == "parity.v1.GenerateRequest"
    assert method.output_type.full_name == "parity.v1.GenerateResponse"


def test_buf_style_unique_request_response_and_unspecified_zero() -> None:
    pool = _pool()
    seen: set[str] = set()
    for service in SERVICES + USER_SERVICES:
        for method in pool.FindServiceByName(service).methods:
            for message in (method.input_type, method.output_type):
                assert message.full_name not in seen, f"{message.full_name} is shared by two RPCs"
                seen.add(message.full_name)
            short = service.split(".")[-1]
            assert method.input_type.name in {f"{method.name}Request", f"{short}{method.name}Request"}
            assert method.output_type.name in {f"{method.name}Response", f"{short}{method.name}Response"}
    from parity.v1 import broadcast_pb2, common_pb2, reward_pb2, rollout_pb2

    for module in (common_pb2, rollout_pb2, broadcast_pb2, reward_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED"), enum.name
