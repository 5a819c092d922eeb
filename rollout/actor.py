"""The actor loop: pull prompts from a task, generate GRPO groups, score them, publish to Redis.

Runs inside the rollout service process (`parity serve rollout --actor true`, or `parity actor`,
which is the same thing; `services.rollout.server` is the only entrypoint) and calls the engine directly, so rollouts and RPC clients share one
engine batch.

Invariants:
  - One Redis entry per group (`RolloutQueue.publish`): protobuf bytes with group/rollout ids
    (`rollout_id = f"{group_id}/{index}"`), per-token versions, min/max versions, the sampling
    params used (for the trainer's replay), rewards, logprobs mode, and the `traceparent` of the
    `publish` span.
  - async mode: the W rollout workers share the bound `max(1, max_lag) * groups_per_step`
    (`backlog_limit`) on the stream's unconsumed groups plus the groups in flight. Each worker sees
    the shared backlog but only its own groups in flight, so it starts a group only while its own
    in flight are fewer than its share of the room left, ceil((limit - backlog) / W) (`may_start`):
    the stream then never holds more than limit + W - 1 groups (with one worker, the limit). The
    time spent waiting is counted (`parity_rollout_backpressure_wait_seconds_total`). The
    trainer acknowledges entries it drops (stale, lost version, duplicate) at once, so only groups
    it can still train hold the actor back.
  - sync mode: generate `groups_per_step` groups at the serving version, publish them, then wait
    until the serving version increases (generate -> train -> update).
  - skip_zero_variance (dynamic sampling): a group whose rewards are all equal carries no GRPO
    advantage; it is counted and not published, and another prompt takes its place (in sync mode,
    within the same version). After `4 * groups_per_step` such drops in a row the next group is
    published anyway, so a task the model always fails (or always solves) still trains and reports.
  - Sync mode draws a round of consecutive prompts at a time and publishes, in draw order, the first
    groups that survive dynamic sampling until the step has `groups_per_step`. A round holds more
    prompts than the step still needs when most groups have been dropped so far (the run's kept
    share, at most `concurrency` groups), so one batch replaces several small ones. Groups after
    the step's last published one (surplus) go back to the stream: the next version generates them
    again with the same seeds. Which groups a step publishes is therefore the same for any round
    size, and a `--resume` run continues exactly where the uninterrupted run would.
  - Nothing is generated while the service is not caught up with the broadcast service.
  - A group lost with a dead engine (its generation failed UNAVAILABLE `engine: ...`) is generated
    again, same prompt and seed, once the restarted engine serves the current version; it is
    counted (`parity_rollout_regenerated_groups_total`) and never published half-done.
  - Prompts come from this worker's `PromptStream` (rollout/tasks/stream.py): every worker builds the
    same task from run.seed and the stream deals it out, so a data set's prompts are each drawn once
    per epoch across the fleet. Rewards are `task.reward`'s scorer (rollout/rewards), awaited off the
    event loop with a deadline; a group whose reward raises, times out or is not finite is dropped,
    logged with the reason and counted (`parity_rollout_rewards_failed_total`), never scored 0.
  - Prompt position: each group is published together with its prompt's draw index (atomically,
    `RolloutQueue.publish(position=...)`); an actor that starts on a stream that already holds its
    worker's groups (`parity run --resume`) continues after the highest published draw, with the
    same prompts and seeds the uninterrupted run would have drawn. Groups in flight at a crash (at
    most `concurrency` in async mode, `groups_per_step / rollout_workers` in sync mode) were never
    published: their prompts are skipped, never drawn twice.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid

from parity import tracing
from parity.config import ParityConfig
from parity.errors import status_for
from parity.faults import parse_fault
from parity.v1 import common_pb2, rollouts_pb2
from rollout import metrics
from rollout.engine import FINISH_REASONS, GenerationSpec
from rollout.rewards import build_scorer
from rollout.rewards.scorer import RewardFailed
from rollout.tasks import Prompt, get_task
from rollout.tasks.chat import needs_tokenizer, request_text, token_ids
from rollout.tasks.stream import PromptStream

log = logging.getLogger("parity.rollout.actor")
EPISODE_ENDS = {
    "done": rollouts_pb2.EPISODE_END_DONE,
    "max_turns": rollouts_pb2.EPISODE_END_MAX_TURNS,
    "context_length": rollouts_pb2.EPISODE_END_CONTEXT_LENGTH,
    "environment_error": rollouts_pb2.EPISODE_END_ENVIRONMENT_ERROR,
}
POLL_S = 0.2


def backlog_limit(max_lag: int, groups_per_step: int) -> int:
    """The async actor's backpressure bound: it starts no group while backlog + in flight reaches
    this. At least one step's groups: the trainer holds the entries of the batch it is building
    pending until its step, so a bound below `groups_per_step` (max_lag 0) would stop the actor
    while the trainer waits for the rest of its batch."""
    return max(1, max_lag) * max(1, groups_per_step)


async def all_or_none(coroutines) -> list:
    """Run `coroutines` together and return their results in order. On the first failure the
    others are cancelled and that error is raised: `asyncio.gather` left them running, so a
    supervised restart of the loop ran beside what was left of the failed one."""
    tasks: list[asyncio.Task] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


def may_start(own_in_flight: int, backlog: int, limit: int, workers: int) -> bool:
    """Whether a worker may start another group (module docstring): its own groups in flight stay
    under its share of the room the backlog leaves, rounded up so that some worker can always start
    while there is room (the trainer may be waiting for the last group of its batch)."""
    room = limit - backlog
    return room > 0 and own_in_flight < -(-room // max(1, workers))


class Actor:
    def __init__(self, run_config: ParityConfig, servicer) -> None:
        self.config = config = run_config.rollout
        self.sampling_config = run_config.task
        # In sync mode each worker generates its share of a step; async actors share one backlog.
        self.groups_per_step = run_config.run.worker_groups_per_step()
        self.max_lag = run_config.run.max_lag
        self.mode = run_config.run.mode
        self.redis_url, self.stream = run_config.run.redis_url, run_config.run.stream
        self.servicer = servicer
        self.engine = servicer.engine
        self.task = get_task(run_config.task.name, seed=run_config.run.seed, config=run_config.task)
        self.scorer = build_scorer(self.task, run_config.task)
        self._stream_args = (run_config.run.seed, config.worker_index, run_config.run.rollout_workers)
        self.workers = run_config.run.rollout_workers
        # Tests only: the episode loop injects the multi-turn classes of a parity fault (the engine the rest).
        self._fault = parse_fault(config.fault, "rollout.fault") if config.fault else None
        self.rewards_failed = 0
        self.worker_id = config.worker_id or f"rollout-{uuid.uuid4().hex[:6]}"
        self._prompts = self.prompt_stream()
        # Every group's sampling seed is a function of the run's engine seed and the prompt's draw
        # index, never of timing: with the same schedule, the same prompt gets the same samples.
        self._seed_base = run_config.engine_seed()
        self._draws = itertools.count()
        self._group_draws: dict[str, int] = {}  # group_id -> its prompt's draw index
        self._positioned = False  # continued after the stream's recorded position (run())
        self._run_id = uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self.groups_published = 0
        self.regenerated_groups = 0
        self.zero_variance_dropped = 0
        self._dropped_in_a_row = 0
        self.surplus_groups = 0
        self._returned: list[tuple[Prompt, int, int]] = []  # surplus draws, generated again next
        # sync mode: (version, groups published at it), kept across an in-process restart of the loop
        self._sync_progress: tuple[int, int] = (-1, 0)
        self.backpressure_wait_s = 0.0
        self.queue = None
        self._group_traceparents: dict[str, str] = {}  # group_id -> its rollout_group span
        self._in_flight = 0
        self._admission = asyncio.Lock()
        self._turn_template = None  # rollout.episodes.TurnTemplate, made on the first episode

    def prompt_stream(self) -> PromptStream:
        """A fresh stream of this worker's training prompts at position 0 (`seek` moves it)."""
        seed, index, workers = self._stream_args
        return PromptStream(self.task, seed=seed, worker_index=index, num_workers=workers)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids under task.chat_template / task.system_prompt (rollout/tasks/chat.py)."""
        c = self.sampling_config
        if needs_tokenizer(prompt, c.chat_template, c.system_prompt):
            return token_ids(self.engine.tokenizer, prompt, c.chat_template, c.system_prompt)
        text = request_text(prompt, c.chat_template, c.system_prompt)
        return self.engine.encode(text, use_chat_template=c.chat_template)

    def _reward_failed(self, group_id: str, prompt: Prompt, failure: RewardFailed) -> None:
        """Drop the group: counted, logged with the reason, never published with a made-up score."""
        self.rewards_failed += 1
        metrics.REWARDS_FAILED.labels(reason=failure.kind).inc()
        self._group_traceparents.pop(group_id, None)
        self._group_draws.pop(group_id, None)  # never published: its draw index is not a position
        log.warning(
            "reward failed for group %s (prompt %s); group dropped: %s (rewards_failed_total=%d)",
            group_id,
            prompt.prompt_id,
            failure,
            self.rewards_failed,
        )

    def sampling(self) -> common_pb2.SamplingParams:
        c = self.sampling_config
        return common_pb2.SamplingParams(
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_tokens, n=c.group_size
        )

    async def _ready(self) -> None:
        while not self.servicer.caught_up or self.servicer.shutting_down:
            await asyncio.sleep(POLL_S)

    async def _backlog(self) -> int:
        try:
            depth = await asyncio.to_thread(self.queue.backlog)
        except Exception:
            metrics.QUEUE_DEPTH.set(float("nan"))  # unknown while Redis is out, not the last value
            raise
        metrics.QUEUE_DEPTH.set(depth)
        return depth

    async def _admit(self) -> None:
        """Wait until this worker may start a group (`may_start`), then claim a slot."""
        limit = backlog_limit(self.max_lag, self.groups_per_step)
        start = None
        async with self._admission:
            # In flight is read (the left operand) before the backlog: a group published between
            # the two reads is then counted twice, never not at all. Read after it, the stream once
            # held limit + 1 groups (the backlog read missed a publish whose group the decrement
            # had already taken off in flight).
            while not may_start(self._in_flight, await self._backlog(), limit, self.workers):
                start = start or time.monotonic()
                await asyncio.sleep(POLL_S)
            self._in_flight += 1
        if start is not None:
            waited = time.monotonic() - start
            self.backpressure_wait_s += waited
            metrics.BACKPRESSURE_SECONDS.inc(waited)

    def _next_prompt(self) -> tuple[Prompt, int, int]:
        """The next training prompt, its group's sampling seed (see __init__) and its draw index."""
        if self._returned:
            return self._returned.pop(0)
        draw = next(self._draws)
        seed = (self._seed_base * 1_000_003 + draw) % (2**63 - 1)
        return next(self._prompts), seed, draw

    def _round_size(self, need: int) -> int:
        """Prompts to draw for a sync round that still needs `need` groups: `need` divided by the
        share of offered groups kept so far (1 at the start), between `need` and `concurrency`."""
        share = (self.groups_published + 1) / (self.groups_published + self.zero_variance_dropped + 1)
        return max(need, min(self.config.concurrency, math.ceil(need / share)))

    @property
    def producer(self) -> str:
        """This worker's name in the stream's producer positions (stable across restarts)."""
        return f"worker{self.config.worker_index}"

    def seek(self, draw: int) -> None:
        """Continue the prompt stream at draw index `draw` (the same prompts and seeds as a run
        that drew `draw` prompts before)."""
        prompts = self.prompt_stream()
        if hasattr(prompts, "seek"):
            prompts.seek(draw)
        else:
            next(itertools.islice(prompts, draw, draw), None)
        self._prompts = prompts
        self._draws = itertools.count(draw)

    async def one_group(
        self, prompt: Prompt, seed: int | None = None, draw: int | None = None
    ) -> rollouts_pb2.RolloutGroup | None:
        """One scored group, or None when its reward failed (the group is dropped and counted)."""
        if getattr(self.task, "is_environment", False):
            return await self.one_episode_group(prompt, seed, draw)
        sampling = self.sampling()
        group_id = f"{self.worker_id}-{self._run_id}-{next(self._counter)}"
        if draw is not None:
            self._group_draws[group_id] = draw
        ids = self.prompt_ids(prompt)
        spec = GenerationSpec(
            request_id=group_id,
            prompt_token_ids=ids,
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
        )
        group_attrs = {"parity.group_id": group_id, "parity.weight_version": self.engine.weight_version}
        with tracing.span("rollout_group", group_attrs):  # parent of generate, score and publish
            self._group_traceparents[group_id] = tracing.current_traceparent()
            results = sorted(await self._generate(spec), key=lambda r: r.index)
            with tracing.span("score", {"parity.group_id": group_id, "task": self.task.name}):
                try:
                    rewards = await self.scorer.score(prompt, [r.text for r in results], request_id=group_id)
                except RewardFailed as failure:
                    self._reward_failed(group_id, prompt, failure)
                    return None
        versions = [v for r in results for v in r.token_weight_versions] or [self.engine.weight_version]
        return rollouts_pb2.RolloutGroup(
            group_id=group_id,
            task=self.task.name,
            prompt_id=prompt.prompt_id,
            prompt_token_ids=ids,
            prompt_text=prompt.text,
            sampling=sampling,
            samples=[
                rollouts_pb2.RolloutSample(
                    rollout_id=f"{group_id}/{r.index}",
                    token_ids=r.token_ids,
                    logprobs=r.logprobs,
                    token_weight_versions=r.token_weight_versions,
                    token_context_versions=r.token_context_versions,
                    text=r.text,
                    reward=reward,
                    finish_reason=FINISH_REASONS[r.finish_reason],
                )
                for r, reward in zip(results, rewards, strict=True)
            ],
            min_weight_version=min(versions),
            max_weight_version=max(versions),
            worker_id=self.worker_id,
            created_at_unix=time.time(),
            logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED
            if self.config.logprobs_mode == "processed"
            else common_pb2.LOGPROBS_MODE_RAW,
        )

    async def one_episode_group(
        self, prompt: Prompt, seed: int | None = None, draw: int | None = None
    ) -> rollouts_pb2.RolloutGroup | None:
        """A group of `n` episodes of one environment record (rollout/episodes.py), or None when an
        environment failed in any of them (the group is dropped and counted, never scored)."""
        from rollout.episodes import (
            FAULTY_ROLLOUTS_LOG,
            TurnTemplate,
            retokenization_drift,
            run_episode,
        )

        c, sampling = self.sampling_config, self.sampling()
        group_id = f"{self.worker_id}-{self._run_id}-{next(self._counter)}"
        if draw is not None:
            self._group_draws[group_id] = draw
        if self._turn_template is None:
            self._turn_template = TurnTemplate(self.engine.tokenizer, c.chat_template)

        def first_prompt(observation: str) -> list[int]:
            return self.prompt_ids(Prompt(prompt.prompt_id, observation, prompt.answer))

        def generate_for(index: int):
            async def generate(ids: list[int], max_tokens: int, turn: int):
                turn_seed = None if seed is None else (seed * 1_000_003 + index * 1009 + turn) % (2**63 - 1)
                spec = GenerationSpec(
                    request_id=f"{group_id}/{index}/t{turn}",
                    prompt_token_ids=ids,
                    n=1,
                    max_tokens=max_tokens,
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    seed=turn_seed,
                )
                (result,) = await self._generate(spec)
                return result

            return generate

        group_attrs = {"parity.group_id": group_id, "parity.weight_version": self.engine.weight_version}
        with tracing.span("rollout_group", group_attrs):
            self._group_traceparents[group_id] = tracing.current_traceparent()
            episodes = await asyncio.gather(
                *(
                    run_episode(
                        self.task.source.new_episode(f"{group_id}/{i}"),
                        prompt.metadata,
                        first_prompt,
                        generate_for(i),
                        self._turn_template,
                        c.max_turns,
                        c.max_episode_tokens,
                        sampling.max_tokens,
                        self._fault,
                        self.engine.max_model_len,
                    )
                    for i in range(sampling.n)
                )
            )
        for episode in episodes:
            metrics.EPISODES.labels(end=episode.end).inc()
            metrics.EPISODE_TURNS.inc(sum(t.role == "model" for t in episode.turns))
        problem, reason = "", ""
        if failed := [e for e in episodes if e.end == "environment_error"]:
            problem, reason = failed[0].error, failed[0].error_reason or "error"
        elif any(e.token_mismatches for e in episodes):
            problem, reason = "a model token differs from the engine's output", "token_mismatch"
        elif any(e.prompt_token_ids != episodes[0].prompt_token_ids for e in episodes):
            problem, reason = (
                "reset(record) gave the episodes of one group different first observations",
                "error",
            )
        if problem:
            metrics.EPISODE_GROUPS_DROPPED.labels(reason=reason).inc()
            self._group_traceparents.pop(group_id, None)
            self._group_draws.pop(group_id, None)
            log.warning("episode group %s (record %s) dropped: %s", group_id, prompt.prompt_id, problem)
            return None
        if self._fault and (changed := [f"{group_id}/{i}" for i, e in enumerate(episodes) if e.faulty_turns]):
            log.warning(FAULTY_ROLLOUTS_LOG, self._fault.fault.name, " ".join(changed))
        tokenizer = self.engine.tokenizer
        samples = []
        for index, episode in enumerate(episodes):
            drift = retokenization_drift(tokenizer, episode.prompt_token_ids, episode.token_ids)
            metrics.RETOKENIZATION_DRIFT.inc(drift)
            model_turns = [t for t in episode.turns if t.role == "model"]
            sample = rollouts_pb2.RolloutSample(
                rollout_id=f"{group_id}/{index}",
                token_ids=episode.token_ids,
                logprobs=episode.logprobs,
                token_weight_versions=episode.weight_versions,
                token_context_versions=episode.context_versions,
                text=episode.text(tokenizer),
                reward=episode.reward,
                finish_reason=FINISH_REASONS[model_turns[-1].finish_reason] if model_turns else 0,
                loss_mask=episode.loss_mask,
                episode_end=EPISODE_ENDS[episode.end],
                token_mismatches=episode.token_mismatches,
                retokenization_drift=drift,
            )
            for turn in episode.turns:
                proto_turn = sample.turns.add(
                    role=rollouts_pb2.TURN_ROLE_MODEL
                    if turn.role == "model"
                    else rollouts_pb2.TURN_ROLE_ENVIRONMENT,
                    start=turn.start,
                    end=turn.end,
                    finish_reason=FINISH_REASONS[turn.finish_reason] if turn.finish_reason else 0,
                )
                if turn.reward is not None:
                    proto_turn.reward = turn.reward
            samples.append(sample)
        versions = [v for e in episodes for v in e.weight_versions] or [self.engine.weight_version]
        return rollouts_pb2.RolloutGroup(
            group_id=group_id,
            task=self.task.name,
            prompt_id=prompt.prompt_id,
            prompt_token_ids=episodes[0].prompt_token_ids,
            prompt_text=episodes[0].first_observation,
            sampling=sampling,
            samples=samples,
            min_weight_version=min(versions),
            max_weight_version=max(versions),
            worker_id=self.worker_id,
            created_at_unix=time.time(),
            logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED
            if self.config.logprobs_mode == "processed"
            else common_pb2.LOGPROBS_MODE_RAW,
        )

    async def _generate(self, spec: GenerationSpec) -> list:
        """The group's completions; a group lost with a dead engine is generated again (docstring)."""
        lost = False
        while True:
            try:
                return [r async for r in self.servicer.run_group(spec)]
            except Exception as exc:
                refusal = status_for(exc)
                if refusal is None or refusal.field != "engine" or self.servicer.shutting_down:
                    raise
                if not lost:  # counted once, however many tries the restart takes
                    lost = True
                    self.regenerated_groups += 1
                    metrics.REGENERATED_GROUPS.inc()
                    log.warning(
                        "group %s lost with the engine (%s); generating it again", spec.request_id, exc
                    )
                await asyncio.sleep(POLL_S)
                await self._ready()  # not before the restarted engine serves the current version

    async def publish(self, group: rollouts_pb2.RolloutGroup) -> str:
        attrs = {
            "parity.group_id": group.group_id,
            "parity.weight_version": group.max_weight_version,
            "completion_tokens": sum(len(s.token_ids) for s in group.samples),
        }
        parent = self._group_traceparents.pop(group.group_id, "")
        draw = self._group_draws.pop(group.group_id, None)
        position = None if draw is None else (self.producer, draw)
        with tracing.span("publish", attrs, kind="producer", parent_traceparent=parent):
            traceparent = tracing.current_traceparent()
            try:
                entry_id = await asyncio.to_thread(self.queue.publish, group, traceparent, position)
            except Exception as exc:
                metrics.UNPUBLISHED_GROUPS.inc()  # counted, not silently gone
                log.error(
                    "group %s (draw %s) not published: %s: %s", group.group_id, draw, type(exc).__name__, exc
                )
                raise
        self.groups_published += 1
        return entry_id

    def _return_surplus(self, drawn: list, groups: list) -> None:
        """Put a sync round's draws after the step's last published group back on the stream."""
        self._return_draws(drawn, groups)
        self.surplus_groups += len(drawn)
        metrics.SURPLUS_GROUPS.inc(len(drawn))

    def _return_draws(self, drawn: list, groups: list) -> None:
        """Draws (and their groups, if any) to generate again: they come first from the stream."""
        for group in groups:
            if group is not None:
                self._group_traceparents.pop(group.group_id, None)
                self._group_draws.pop(group.group_id, None)
        self._returned = list(drawn) + self._returned

    async def offer(self, group: rollouts_pb2.RolloutGroup) -> bool:
        """Publish `group` unless dynamic sampling drops it; True when it was published."""
        rewards = [s.reward for s in group.samples]
        flat = not rewards or max(rewards) - min(rewards) <= 1e-9
        if self.config.skip_zero_variance and flat and self._dropped_in_a_row < self.drop_limit:
            self._dropped_in_a_row += 1
            self.zero_variance_dropped += 1
            metrics.ZERO_VARIANCE_DROPPED.inc()
            self._group_traceparents.pop(group.group_id, None)
            self._group_draws.pop(group.group_id, None)
            return False
        self._dropped_in_a_row = 0
        await self.publish(group)
        return True

    @property
    def drop_limit(self) -> int:
        return 4 * self.groups_per_step

    def _done(self) -> bool:
        return bool(self.config.max_groups) and self.groups_published >= self.config.max_groups

    async def _async_worker(self) -> None:
        while not self._done() and not self.servicer.shutting_down:
            await self._ready()
            await self._admit()
            try:
                group = await self.one_group(*self._next_prompt())
                if self._done():
                    return
                if group is not None:
                    await self.offer(group)
            finally:
                self._in_flight -= 1

    async def _sync_loop(self) -> None:
        limit = asyncio.Semaphore(self.config.concurrency)

        async def bounded(prompt: Prompt, seed: int, draw: int) -> rollouts_pb2.RolloutGroup:
            async with limit:
                return await self.one_group(prompt, seed, draw)

        while not self._done() and not self.servicer.shutting_down:
            await self._ready()
            version = self.engine.weight_version
            # A loop restarted mid-step (its supervisor, after a failed publish) finishes the share
            # it began: publishing a whole share again put part of every later step at lag 1.
            done_version, done = self._sync_progress
            published = done if done_version == version else 0
            while published < self.groups_per_step and not self.servicer.shutting_down:
                drawn = [
                    self._next_prompt() for _ in range(self._round_size(self.groups_per_step - published))
                ]
                groups = await all_or_none(bounded(*d) for d in drawn)
                for index, group in enumerate(groups):
                    if published >= self.groups_per_step:
                        self._return_surplus(drawn[index:], groups[index:])
                        break
                    if group is not None:
                        try:
                            published += await self.offer(group)
                        except BaseException:  # not published: these draws come first after a restart
                            self._return_draws(drawn[index:], groups[index:])
                            raise
                        self._sync_progress = (version, published)
            log.info(
                "sync step at v%d: published %d groups (%d dropped for zero variance so far, %d surplus "
                "returned to the stream); waiting for v%d",
                version,
                published,
                self.zero_variance_dropped,
                self.surplus_groups,
                version + 1,
            )
            start = time.monotonic()
            while (
                self.engine.weight_version <= version and not self.servicer.shutting_down and not self._done()
            ):
                await asyncio.sleep(POLL_S)
            waited = time.monotonic() - start
            self.backpressure_wait_s += waited
            metrics.BACKPRESSURE_SECONDS.inc(waited)

    async def run(self) -> None:
        from parity.rollout_queue import RolloutQueue

        self.queue = RolloutQueue(self.redis_url, stream=self.stream)
        if not self._positioned:  # once per actor: an in-process restart keeps its own position
            last = await asyncio.to_thread(self.queue.producer_position, self.producer)
            if last is not None:
                self.seek(last + 1)
                log.info("actor: continuing the prompt stream at draw %d (recorded in the stream)", last + 1)
            self._positioned = True
        log.info(
            "actor: task=%s mode=%s group_size=%d max_lag=%d groups_per_step=%d concurrency=%d",
            self.task.name,
            self.mode,
            self.sampling_config.group_size,
            self.max_lag,
            self.groups_per_step,
            self.config.concurrency,
        )
        try:
            if self.mode == "sync":
                await self._sync_loop()
            else:
                await all_or_none(self._async_worker() for _ in range(self.config.concurrency))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("actor loop failed")
            raise
        finally:
            log.info(
                "actor stopped after %d groups (%d dropped for zero variance, backpressure wait %.1fs, "
                "rewards_failed_total=%d)",
                self.groups_published,
                self.zero_variance_dropped,
                self.backpressure_wait_s,
                self.rewards_failed,
            )
