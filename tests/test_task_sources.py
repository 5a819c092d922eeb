"""Task sources (issue 18): jsonl, hf datasets on disk, reasoning-gym, module factories; the held-out
split; the prompt stream (epochs, fleet partition, seek); chat rendering. No vLLM, no processes."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from parity.config import load
from parity.config.task import TaskConfig
from rollout.tasks import Prompt, TaskError, get_task
from rollout.tasks.stream import PromptStream

ROOT = Path(__file__).resolve().parent.parent
GSM8K_MINI = ROOT / "examples" / "gsm8k_mini.jsonl"


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _records(n: int, offset: int = 0) -> list[dict]:
    return [
        {"id": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}
        for i in range(offset, offset + n)
    ]


def _disjoint(task) -> None:
    train, held_out = task.train_set(), task.eval_prompts(10_000)
    assert held_out and train
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held_out}
    assert not {p.text for p in train} & {p.text for p in held_out}


# --- jsonl ------------------------------------------------------------------------------------------
def test_example_gsm8k_mini_loads_and_holds_out_a_disjoint_set() -> None:
    task = get_task(f"jsonl:{GSM8K_MINI}")
    assert len(task.train_set()) + len(task.eval_prompts(10_000)) == 40
    _disjoint(task)
    first = task.train_set()[0]
    assert first.prompt_id.startswith("gsm8k-mini-") and first.answer.isdigit()
    assert first.metadata == {"source": "written for Parity's examples"}
    # The split hashes the prompt text, not the seed: the same held-out set at every seed.
    assert get_task(f"jsonl:{GSM8K_MINI}", seed=5).eval_prompts(100) == task.eval_prompts(100)


def test_eval_task_is_held_out_by_id_and_by_text(tmp_path: Path) -> None:
    train = _records(20)
    train.append({"id": "same-text", "prompt": "What is 30 + 1?", "answer": "31"})  # text of e30
    train.append({"id": "e31", "prompt": "a different text, same id as an eval record", "answer": "1"})
    evals = [{"id": f"e{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in (30, 31, 32)]
    config = TaskConfig(eval_task=f"jsonl:{_write(tmp_path / 'eval.jsonl', evals)}")
    task = get_task(f"jsonl:{_write(tmp_path / 'train.jsonl', train)}", config=config)
    assert [p.prompt_id for p in task.eval_prompts(10)] != [] and len(task.eval_prompts(10)) == 3
    assert {p.prompt_id for p in task.train_set()} == {f"q{i}" for i in range(20)}  # both clashes left out
    _disjoint(task)


def test_messages_records_and_metadata(tmp_path: Path) -> None:
    record = {
        "id": "chat-1",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "answer": 4,
        "metadata": {"level": 1},
        "topic": "sums",
    }
    path = _write(tmp_path / "chat.jsonl", [record, *_records(30)])
    prompt = next(
        p
        for p in get_task(f"jsonl:{path}", config=TaskConfig(eval_fraction=0.01)).train_set()
        if p.prompt_id == "chat-1"
    )
    assert prompt.messages == (("system", "Be brief."), ("user", "2+2?"))
    assert prompt.text == "system: Be brief.\nuser: 2+2?" and prompt.answer == "4"
    assert prompt.metadata == {"level": 1, "topic": "sums"}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], r"bad\.jsonl:2: not valid JSON"),
        (['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b"}'], r"bad\.jsonl:3: missing field 'answer'"),
        (['{"answer": "1"}'], r"bad\.jsonl:1: a record needs exactly one of 'prompt' or 'messages'"),
        (['{"prompt": "a", "messages": [], "answer": "1"}'], r"bad\.jsonl:1: a record needs exactly one"),
        (['{"prompt": "  ", "answer": "1"}'], r"bad\.jsonl:1: field 'prompt' is empty"),
        (['{"prompt": ["a"], "answer": "1"}'], r"bad\.jsonl:1: field 'prompt' must be a string"),
        (['{"messages": [{"role": "robot", "content": "x"}], "answer": "1"}'], r"bad\.jsonl:1: field messages\[0\]\.role"),
        (['{"messages": [{"role": "assistant", "content": "x"}], "answer": "1"}'], r"must not end with an assistant"),
        (['[1, 2]'], r"bad\.jsonl:1: a record must be a JSON object"),
        (['{"id": "x", "prompt": "a", "answer": "1"}', '{"id": "x", "prompt": "b", "answer": "2"}'], r"bad\.jsonl:2: id 'x' repeats the record at .*bad\.jsonl:1"),
    ],
)  # fmt: skip
def test_malformed_jsonl_names_the_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TaskError, match=message):
        get_task(f"jsonl:{path}")


def test_missing_file_and_unknown_source_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"^task\.name: cannot read .*nope\.jsonl"):
        get_task(f"jsonl:{tmp_path / 'nope.jsonl'}")
    with pytest.raises(TaskError, match=r"^task: unknown task 'chess'"):
        get_task("chess")
    with pytest.raises(TaskError, match=r"^task\.eval_task: must be jsonl:PATH or hf:PATH"):
        get_task(f"jsonl:{GSM8K_MINI}", config=TaskConfig(eval_task="reasoning_gym:leg_counting"))


# --- hf (datasets, from disk only) --------------------------------------------------------------------
def test_hf_save_to_disk_with_mapped_columns_and_split(tmp_path: Path) -> None:
    import datasets

    rows = {"question": [f"Q{i}?" for i in range(30)], "solution": [str(i) for i in range(30)]}
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(rows),
            "test": datasets.Dataset.from_dict({"question": ["T?"], "solution": ["1"]}),
        }
    ).save_to_disk(str(tmp_path / "ds"))
    config = TaskConfig(prompt_field="question", answer_field="solution")
    task = get_task(f"hf:{tmp_path / 'ds'}:train", config=config)
    assert len(task.train_set()) + len(task.eval_prompts(100)) == 30
    assert task.train_set()[0].answer == task.train_set()[0].text.removeprefix("Q").removesuffix("?")
    _disjoint(task)
    held = get_task(
        f"hf:{tmp_path / 'ds'}", config=config.model_copy(update={"eval_task": f"hf:{tmp_path / 'ds'}:test"})
    )
    assert [p.text for p in held.eval_prompts(5)] == ["T?"] and len(held.train_set()) == 30
    with pytest.raises(TaskError, match=r"no split 'dev'; splits: train, test"):
        get_task(f"hf:{tmp_path / 'ds'}:dev", config=config)
    with pytest.raises(TaskError, match=r"ds\[train\] row 0: missing field 'answer'"):
        get_task(f"hf:{tmp_path / 'ds'}:train", config=TaskConfig(prompt_field="question"))
    with pytest.raises(TaskError, match="read from disk only"):
        get_task("hf:some-org/some-dataset")


def test_hf_reads_a_local_jsonl_file() -> None:
    task = get_task(f"hf:{GSM8K_MINI}")
    assert len(task.train_set()) + len(task.eval_prompts(100)) == 40


# --- reasoning-gym ------------------------------------------------------------------------------------
def test_reasoning_gym_is_seeded_disjoint_and_scored_in_unit_range() -> None:
    config = TaskConfig(dataset_size=200, eval_size=20)
    task = get_task("reasoning_gym:basic_arithmetic", seed=1, config=config)
    assert len(task.train_set()) <= 200 and len(task.eval_prompts(100)) == 20
    _disjoint(task)
    assert [p.text for p in get_task("reasoning_gym:basic_arithmetic", 1, config).train_set()] == [
        p.text for p in task.train_set()
    ]
    assert [p.text for p in get_task("reasoning_gym:basic_arithmetic", 2, config).train_set()] != [
        p.text for p in task.train_set()
    ]
    # At the eval set's own seed the generator repeats the eval questions: they leave training.
    same_seed = get_task("reasoning_gym:basic_arithmetic", seed=1_000_003, config=config)
    _disjoint(same_seed)
    assert len(same_seed.train_set()) == 200 - 20
    prompt = task.train_set()[0]
    assert task.reward(prompt, prompt.answer) == 1.0
    assert task.reward(prompt, f"thinking... <answer>{prompt.answer}</answer>") == 1.0
    assert task.reward(prompt, "no idea") == 0.0
    for p in task.eval_prompts(20):
        assert 0.0 <= task.reward(p, "17") <= 1.0


def test_reasoning_gym_several_names_score_each_with_its_own_generator() -> None:
    task = get_task(
        "reasoning_gym:basic_arithmetic,leg_counting", config=TaskConfig(dataset_size=40, eval_size=4)
    )
    sources = Counter(p.metadata["source_dataset"] for p in task.train_set())
    assert set(sources) == {"basic_arithmetic", "leg_counting"}
    for prompt in task.train_set()[:10]:
        assert task.reward(prompt, prompt.answer) == 1.0


def test_unknown_reasoning_gym_name_lists_the_available_ones() -> None:
    with pytest.raises(
        TaskError,
        match=r"unknown reasoning-gym name\(s\) 'basic_arithmetik'; available: .*basic_arithmetic.*leg_counting",
    ):
        get_task("reasoning_gym:basic_arithmetik")


def test_run_config_rejects_an_unknown_reasoning_gym_name_before_start_up() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "commands.main", "run", "--task", "reasoning_gym:nope", "--model", "tiny"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "task.name: unknown reasoning-gym name(s) 'nope'; available:" in proc.stderr
    assert "basic_arithmetic" in proc.stderr and "Traceback" not in proc.stderr


# --- module:factory -----------------------------------------------------------------------------------
def test_module_factory_task() -> None:
    task = get_task("tests.reward_helpers:make_task", seed=3)
    assert task.name == "countdown" and len(task.train_set()) == 12
    with pytest.raises(TaskError, match=r"^task\.name: cannot import 'no_such_module'"):
        get_task("no_such_module:make")
    with pytest.raises(TaskError, match=r"^task\.name: 'tests\.reward_helpers' has no attribute 'nope'"):
        get_task("tests.reward_helpers:nope")


# --- the prompt stream ----------------------------------------------------------------------------------
def test_fleet_draws_every_prompt_once_per_epoch_without_duplicates() -> None:
    task = get_task(f"jsonl:{GSM8K_MINI}")
    n = len(task.train_set())
    for workers in (1, 3, 4):
        streams = [PromptStream(task, seed=7, worker_index=w, num_workers=workers) for w in range(workers)]
        for epoch in range(2):
            drawn = []
            for stream in streams:
                assert stream.epoch == epoch
                share = len(range(stream.worker_index, n, workers))
                drawn += [stream.next().prompt_id for _ in range(share)]
            assert len(drawn) == n and len(set(drawn)) == n, (workers, epoch)
    one = PromptStream(task, seed=7)
    first, second = [one.next().prompt_id for _ in range(n)], [one.next().prompt_id for _ in range(n)]
    assert first != second and sorted(first) == sorted(second)  # reshuffled per epoch
    assert first != [PromptStream(task, seed=8).next().prompt_id for _ in range(n)]  # and per seed


@pytest.mark.parametrize("spec", ["arithmetic_final", f"jsonl:{GSM8K_MINI}"])
def test_seek_resumes_exactly_where_a_stream_stopped(spec: str) -> None:
    task = get_task(spec, seed=2)
    fresh = PromptStream(task, seed=2, worker_index=1, num_workers=2)
    drawn = [fresh.next() for _ in range(100)]
    assert fresh.position == 100
    resumed = PromptStream(task, seed=2, worker_index=1, num_workers=2)
    resumed.seek(57)
    assert resumed.position == 57
    assert [resumed.next() for _ in range(43)] == drawn[57:]


def test_endless_task_is_dealt_round_robin_and_one_worker_keeps_todays_stream() -> None:
    task = get_task("arithmetic_final", seed=4)
    today = list(itertools.islice(get_task("arithmetic_final", seed=4).train_prompts(), 60))
    assert [PromptStream(task, seed=4).next() for _ in range(1)] == today[:1]
    one = PromptStream(task, seed=4)
    assert [one.next() for _ in range(60)] == today and one.epoch is None
    two = [PromptStream(task, seed=4, worker_index=w, num_workers=2) for w in range(2)]
    dealt = [two[0].next() for _ in range(30)], [two[1].next() for _ in range(30)]
    assert dealt[0] == today[0::2] and dealt[1] == today[1::2]


def test_stream_refuses_a_worker_outside_the_fleet_or_an_empty_share() -> None:
    task = get_task(f"jsonl:{GSM8K_MINI}")
    with pytest.raises(TaskError, match=r"rollout\.worker_index: must be in \[0, run\.rollout_workers=2\)"):
        PromptStream(task, worker_index=2, num_workers=2)
    with pytest.raises(TaskError, match=r"fewer than run\.rollout_workers=64"):
        PromptStream(task, worker_index=0, num_workers=64)


# --- chat rendering and config ----------------------------------------------------------------------------
def test_chat_rendering_on_off_and_system_prompt() -> None:
    from transformers import AutoTokenizer

    from parity import models
    from rollout.tasks.chat import check_prompt_format, token_ids
    from rollout.vllm_engine import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(models.resolve("tiny")))
    plain = Prompt("p", "What is 2 + 2?", "4")
    assert token_ids(tokenizer, plain, True, "") == encode_prompt(tokenizer, plain.text, True)  # today's
    assert token_ids(tokenizer, plain, False, "") == encode_prompt(tokenizer, plain.text, False)
    with_system = tokenizer.decode(token_ids(tokenizer, plain, True, "You add numbers."))
    assert "You add numbers." in with_system and "What is 2 + 2?" in with_system
    chat = Prompt("c", "user: hi", "x", messages=(("system", "S1"), ("user", "hi")))
    rendered = tokenizer.decode(token_ids(tokenizer, chat, True, "S2"))
    assert "S1" in rendered and "S2" not in rendered  # the record's own system turn wins
    check_prompt_format([plain, chat], chat_template=True)
    with pytest.raises(TaskError, match=r"^task\.chat_template: off, but record 'c' is given as messages"):
        check_prompt_format([plain, chat], chat_template=False)


def test_task_flags_resolve_into_the_task_section() -> None:
    cfg = load(
        ["--task", "jsonl:x.jsonl", "--reward", "0.5*exact,0.5*math_verify", "--eval_task", "jsonl:y.jsonl",
         "--chat_template", "off", "--system_prompt", "Be brief.", "--eval_every", "2", "--eval_pass_k", "4"],
        home="run", environ={},
    ).config.task  # fmt: skip
    assert (cfg.name, cfg.reward, cfg.eval_task) == (
        "jsonl:x.jsonl",
        "0.5*exact,0.5*math_verify",
        "jsonl:y.jsonl",
    )
    assert (cfg.chat_template, cfg.system_prompt, cfg.eval_every, cfg.eval_pass_k) == (
        False,
        "Be brief.",
        2,
        4,
    )
    assert load([], home="run", environ={}).config.task.name == "arithmetic_final"  # the default stays


def test_example_reasoning_gym_config_passes_start_up_validation() -> None:
    from commands.run.launcher import validate_inputs

    flags = ["--config", str(ROOT / "examples" / "reasoning_gym.toml"), "--model", "tiny"]
    task = validate_inputs(load(flags, home="run", environ={}).config)
    assert task.name == "reasoning_gym:basic_arithmetic,leg_counting"
    assert len(task.eval_prompts(50)) == 50


def test_an_environment_service_that_is_not_there_fails_start_up_naming_the_field() -> None:
    """`--task env:grpc:HOST:PORT` with nothing listening: one line naming task.name and the
    address, before any process starts (no traceback)."""
    from commands.run.launcher import RunConfigError, validate_inputs
    from parity.ports import free_port

    spec = f"env:grpc:127.0.0.1:{free_port()}"
    flags = ["--task", spec, "--model", "tiny", "--task.env_retries", "0"]
    with pytest.raises(RunConfigError, match=r"^task\.name: ") as info:
        validate_inputs(load(flags, home="run", environ={}).config)
    assert spec in str(info.value) and "UNAVAILABLE" in str(info.value), info.value


def test_a_held_out_set_smaller_than_eval_size_is_said_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from commands.run.launcher import validate_inputs

    def note(*flags: str) -> str | None:
        capsys.readouterr()
        validate_inputs(load(["--model", "tiny", *flags], home="run", environ={}).config)
        lines = [line for line in capsys.readouterr().out.splitlines() if "held-out set:" in line]
        assert len(lines) <= 1, lines
        return lines[0].split("] ", 1)[1] if lines else None

    few = tmp_path / "few.jsonl"
    few.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(2))
    )
    assert note("--task", f"jsonl:{few}") == (
        "held-out set: 0 prompts, fewer than task.eval_size 100 (nothing to evaluate; give a held-out "
        "file with --eval_task, or raise --task.eval_fraction)"
    )
    assert note("--task", "env:guess_number") == (
        "held-out set: 65 prompts, fewer than task.eval_size 100 (accuracy is over those)"
    )
    assert note("--task", "env:guess_number", "--task.eval_size", "50") is None
    assert note() is None  # the default task holds 100
    assert note("--task", f"jsonl:{few}", "--task.eval_size", "0") is None  # no evaluation asked for
