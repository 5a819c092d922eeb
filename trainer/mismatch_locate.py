"""Where a train-inference mismatch lives, and which known faults most likely made it.

Run when the running gate fires (trainer/mismatch_gate.py) and by `parity check --faults`. Input:
the step's rollout groups and the trainer's frozen copy with its weight history (the weights of
every version the tokens were sampled at). Output, a `MismatchReport`:

- **Where**: the backend mismatch (k3 of the engine's logprobs against the trainer's at each token's
  own version) by token position (first, middle, last model token of a sample), by worker, by
  weight version, by whether a token's tag is older than its sample's newest, and by sampling
  setting.
- **Which**: each fault class of the catalogue (parity/faults.py) that a replay can test is a
  hypothesis: "the engine reported what the trainer computes under this change". Its score is the
  share of the mismatch it explains, 1 - d(hypothesis, engine) / d(trainer, engine), where d is the
  mean per-token |logprob difference| capped at CAP_NATS (a token the hypothesis puts outside its
  distribution costs the cap), and 0 when it makes the mismatch worse. The tested
  changes are grids: temperature, top-k and top-p (one differing: that setting; several at once: a
  generation_config leak), repetition and presence penalties, raw logits, a bf16 head or bf16
  weights, RoPE theta, a left-truncated prompt, a prompt whose first token is doubled or missing (a
  chat template's BOS), one tensor kept at v-1 (searched layer by layer), every
  same-shaped pair of tensors in a layer swapped, the whole model at v-1 (on every worker, or one),
  the prompt's KV from an older version (all but its last token, or the prompts' shared prefix in
  whole KV blocks), the first token at v-1, the newest tag for every token, logprobs shifted
  by one, the last token's logprob alone, and in multi-turn episodes the later model turns
  conditioned on the decode-then-encode round trip of the episode so far (with the model's
  tokenizer) or at newer weights than their tags. Prompt drift that no replay rebuilds (the
  engine conditioned on other prompt tokens) also scores by what nothing else explains.
  Mixed-context tokens (KV from older weights than sampled them) are left out, as the own-version
  check leaves them out.
- In episodes, the mismatch is also split by model turn (the first, and the later ones).

Costs: it runs only when the gate acts. The tensor searches (whole layers at v-1, then each tensor
of the two best layers; every same-shaped pair in a layer swapped) use `max_tensor_samples` samples
and stop at `budget_s` (what was left out is logged); the rest is a few dozen forwards and the
sampling grids over at most `max_samples` samples.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity import mismatch
from parity.faults import FAULTS
from parity.sampling import (
    SamplingTransform,
    presence_penalised,
    processed_logprobs,
    repetition_penalised,
)
from parity.versions import impossible_tags

if TYPE_CHECKING:
    import torch

    from trainer.weight_history import WeightHistory

log = logging.getLogger(__name__)

UNREPLAYABLE = ("prompt_token_drift",)  # the drifts no replay rebuilds are scored by what is left
PROMPT_EDITS = (  # chat-template drift at the prompt's start: a BOS (or opening token) doubled, or lost
    (lambda p: p[:1] + p, "twice"),
    (lambda p: p[1:], "missing"),
)
TOP = 3
MISMATCH_REPORT = "mismatch_report"  # in the run directory: .json and .png
PARSIMONY = 0.02  # what a change of several sampling settings gives up against one
CAP_NATS = 10.0  # one token's largest share of the distance a hypothesis is scored by
KV_BLOCKS = (16, 128)  # vLLM's KV block sizes: the GPU default, and the CPU backend's


@dataclass(frozen=True)
class Slice:
    tokens: int
    k3: float  # over the tokens finite on both sides
    max_abs: float
    distance: float  # mean |delta| per token, capped (see _distance): every token counts
    outside: int  # tokens the engine sampled that the trainer's replay excludes (trainer -inf)


@dataclass(frozen=True)
class Candidate:
    fault: str
    score: float  # share of the mismatch the hypothesis explains, 0..1
    evidence: str


@dataclass
class MismatchReport:
    tokens: int
    k3: float
    by_position: dict[str, Slice] = field(default_factory=dict)
    by_worker: dict[str, Slice] = field(default_factory=dict)
    by_version: dict[str, Slice] = field(default_factory=dict)
    by_tag: dict[str, Slice] = field(default_factory=dict)
    by_sampling: dict[str, Slice] = field(default_factory=dict)
    by_turn: dict[str, Slice] = field(default_factory=dict)  # episodes only: first / later model turns
    candidates: list[Candidate] = field(default_factory=list)

    def top(self, n: int = TOP) -> list[str]:
        return [c.fault for c in self.candidates[:n]]

    def summary(self) -> str:
        """One paragraph: where the mismatch is largest, and the likeliest classes."""
        parts = []
        tables = (("position", self.by_position), ("worker", self.by_worker), ("turn", self.by_turn))
        for name, table in tables:
            measured = {k: s for k, s in table.items() if s.tokens}
            if len(measured) > 1:
                worst = max(measured, key=lambda k: measured[k].distance)
                parts.append(f"largest at {name} {worst} (mean |delta| {measured[worst].distance:.2e})")
        likely = "; ".join(f"{c.fault} ({c.score:.0%}: {c.evidence})" for c in self.candidates[:TOP])
        where = ", ".join(parts) or "spread evenly"
        return f"mismatch over {self.tokens} tokens, k3 {self.k3:.2e}, {where}. Most likely: {likely}."

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: Path) -> list[Path]:
        """`path`.json and, where matplotlib is present, `path`.png; returns what was written."""
        json_path = path.with_suffix(".json")
        json_path.write_text(json.dumps(self.to_json(), indent=1, default=float) + "\n")
        written = [json_path]
        with contextlib.suppress(ImportError):
            written.append(plot(self, path.with_suffix(".png")))
        return written


@dataclass
class _Sample:
    prompt: list[int]
    completion: list[int]  # every completion token (an episode's environment tokens included)
    model_at: list[int]  # indices into completion of the model's clean tokens
    rollout: list[float]  # per model token
    versions: list[int]  # per model token
    transform: SamplingTransform
    worker: str
    starts: list[int]  # per model token, the completion index where its model turn starts (0: the first)
    last_at: int  # the completion index of the sample's last model token (clean or not)

    def is_last(self, j: int) -> bool:
        return self.model_at[j] == self.last_at


def _turn_starts(model_at: list[int]) -> list[int]:
    """Per model token (completion indices `model_at`), where its model turn starts."""
    out, start = [], 0
    for k, at in enumerate(model_at):
        if k and at != model_at[k - 1] + 1:
            start = at
        out.append(start)
    return out


def _later_turns(starts: list[int]) -> list[list[int]]:
    """Per later model turn, in order, the indices of its model tokens (`starts` as _turn_starts)."""
    turns: dict[int, list[int]] = {}
    for k, start in enumerate(starts):
        if start:
            turns.setdefault(start, []).append(k)
    return list(turns.values())


def samples_of(groups: Sequence[Any], max_samples: int) -> list[_Sample]:
    """Up to `max_samples` samples with a logprob per model token, round-robin over the groups.
    Mixed-context tokens (their KV came from older weights than sampled them, a keep-mode update
    in flight: `token_context_versions`) are left out, as the own-version check leaves them out:
    no replay at one version rebuilds them."""
    per_group = []
    for group in groups:
        transform = SamplingTransform.from_proto(group.sampling)
        chosen = []
        for s in group.samples:
            mask = list(s.loss_mask) or [True] * len(s.token_ids)
            model_at = [i for i, m in enumerate(mask) if m]
            if (
                not model_at
                or len(s.logprobs) != len(model_at)
                or len(s.token_weight_versions) != len(model_at)
            ):
                continue
            versions = [int(v) for v in s.token_weight_versions]
            contexts = [int(c) for c in s.token_context_versions] or versions
            # A context newer than its token is no keep-mode token but an impossible tag: kept (tags()).
            keep = [k for k in range(len(model_at)) if k >= len(contexts) or contexts[k] >= versions[k]]
            if not keep:
                continue
            starts = _turn_starts(model_at)
            chosen.append(
                _Sample(list(group.prompt_token_ids), list(s.token_ids), [model_at[k] for k in keep],
                        [float(s.logprobs[k]) for k in keep], [versions[k] for k in keep], transform,
                        group.worker_id or "-", [starts[k] for k in keep], model_at[-1])
            )  # fmt: skip
        per_group.append(chosen)
    out: list[_Sample] = []
    for row in itertools.zip_longest(*per_group):
        out += [s for s in row if s is not None]
    return out[:max_samples]


class _Scorer:
    """Forwards of the frozen copy under the history's weights, with one change at a time. Logits
    come out as the trainer's scorer computes them (`forward`): in bf16 mode the decoder's bf16
    hidden state and the head weight rounded to bf16, with float32 products."""

    def __init__(self, lm, history: WeightHistory, precision: str = "fp32") -> None:
        import torch

        self.lm, self.history, self.precision = lm, history, precision
        self.decoder = getattr(lm, lm.base_model_prefix)
        self.params = dict(lm.named_parameters())
        self.device = next(lm.parameters()).device
        self.loaded: tuple | None = None
        self.dirty: set[str] | None = None  # the tensors the loaded change made differ from the history
        self.torch = torch

    def load(self, version: int, change: Callable[[dict], dict] | None = None, key: Any = None) -> bool:
        """The history's weights of `version`, with `change` applied (`key` names the change).
        Between changes of one version only the tensors a change touches are copied."""
        if self.loaded == (version, key):
            return True
        weights = self.history.get(version)
        if weights is None:
            return False
        changed = change(dict(weights)) if change is not None else weights
        touched = {n for n, t in changed.items() if t is not weights.get(n)}
        with self.torch.no_grad():
            if self.loaded is not None and self.loaded[0] == version and self.dirty is not None:
                names = self.dirty | touched  # restore the last change's tensors, apply this one's
            else:
                names = set(changed)
            for name in names:
                if name in self.params:
                    self.params[name].copy_(changed[name] if name in changed else weights[name])
        self.loaded, self.dirty = (version, key), touched
        return True

    def forward(self, ids: torch.Tensor, past: Any = None, cache: bool = False) -> tuple[torch.Tensor, Any]:
        """float32 logits [L, V] of `ids` [1, L] (after the KV cache `past`, if any), scored by the
        trainer's head (`head_logits`), and the KV cache when `cache`."""
        from trainer.policy import head_logits

        with self.torch.no_grad():
            out = self.decoder(input_ids=ids, past_key_values=past, use_cache=cache)
            logits = head_logits(self.lm, out.last_hidden_state[0], self.precision)
        return logits, out.past_key_values if cache else None

    def logits(self, sample: _Sample, prompt: list[int] | None = None) -> torch.Tensor:
        """[completion, V] float32 logits predicting each completion token."""
        prompt = sample.prompt if prompt is None else prompt
        ids = self.torch.tensor([prompt + sample.completion], device=self.device)
        return self.forward(ids)[0][len(prompt) - 1 : -1]

    def hidden_and_head(self, sample: _Sample) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.torch.tensor([sample.prompt + sample.completion], device=self.device)
        with self.torch.no_grad():
            hidden = self.decoder(input_ids=ids).last_hidden_state[0]
        p = len(sample.prompt)
        return hidden[p - 1 : -1].float(), self.lm.get_output_embeddings().weight.float()

    def stale_prefix_logits(
        self, sample: _Sample, version: int, stale: int, cached: int
    ) -> torch.Tensor | None:
        """The prompt's first `cached` tokens encoded at version `stale`, the rest of the sample at
        `version` attending to them (a prefix cache hit on KV an older version computed)."""
        if not 0 < cached < len(sample.prompt) or not self.load(stale):
            return None
        ids = self.torch.tensor([sample.prompt + sample.completion], device=self.device)
        _, kv = self.forward(ids[:, :cached], cache=True)
        if not self.load(version):
            return None
        logits, _ = self.forward(ids[:, cached:-1], past=kv)
        return logits[len(sample.prompt) - 1 - cached :]


def _chosen(
    logits_LV: torch.Tensor, sample: _Sample, transform: SamplingTransform | None = None
) -> torch.Tensor:
    """Processed logprobs of the sample's model tokens (`transform` None: raw log-softmax)."""
    import torch

    at = torch.tensor(sample.model_at, device=logits_LV.device)
    rows_MV = logits_LV[at]
    targets = torch.tensor([sample.completion[i] for i in sample.model_at], device=logits_LV.device)
    lp_MV = rows_MV.log_softmax(-1) if transform is None else processed_logprobs(rows_MV, transform)
    return lp_MV.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu()


def _penalised_logprobs(logits_LV: torch.Tensor, sample: _Sample, kind: str, value: float) -> torch.Tensor:
    """Processed logprobs after a repetition (seen in prompt or completion) or presence (seen in the
    completion) penalty applied before the transform, vLLM's rules."""
    import torch

    out = []
    for j in sample.model_at:
        row_1V = logits_LV[j : j + 1]
        if kind == "presence":
            row_1V = presence_penalised(row_1V, sample.completion[:j], value)
        else:
            row_1V = repetition_penalised(row_1V, sample.prompt + sample.completion[:j], value)
        out.append(processed_logprobs(row_1V, sample.transform)[0, sample.completion[j]])
    return torch.stack(out).cpu()


def _transform_grid(t: SamplingTransform) -> list[SamplingTransform]:
    temps = {t.temperature, t.temperature * 1.5, t.temperature / 1.5, t.temperature * 2, 0.7, 1.0}
    top_ks = {t.top_k, 0, 20, 50, t.top_k * 2, t.top_k * 4}
    top_ps = {t.top_p, 1.0, 0.8, 0.9, 0.95}
    return [
        SamplingTransform(a, b, c)
        for a, b, c in itertools.product(sorted(temps), sorted(top_ks), sorted(top_ps))
        if (a, b, c) != (t.temperature, t.top_k, t.top_p) and a > 0
    ]


def _differs(a: SamplingTransform, b: SamplingTransform) -> list[str]:
    out = []
    if not math.isclose(a.temperature, b.temperature):
        out.append("temperature")
    if a.top_k != b.top_k:
        out.append("top_k")
    if not math.isclose(a.top_p, b.top_p):
        out.append("top_p")
    return out


def _distance(pred: Sequence[float], rollout: Sequence[float]) -> float:
    """Mean |pred - engine| per token, each capped at CAP_NATS; a token the prediction puts outside
    its distribution (-inf) while the engine sampled it costs the cap (that hypothesis cannot be
    what the engine did). Unlike k3 it stays finite when the trainer's own replay excludes a token."""
    total = 0.0
    for a, b in zip(pred, rollout, strict=True):
        d = abs(a - b) if math.isfinite(a) and math.isfinite(b) else (0.0 if a == b else math.inf)
        total += min(d, CAP_NATS)
    return total / max(1, len(pred))


def _slice(pred: Sequence[float], rollout: Sequence[float]) -> Slice:
    stats = mismatch.mismatch_stats(pred, rollout)
    outside = sum(not math.isfinite(a) and math.isfinite(b) for a, b in zip(pred, rollout, strict=True))
    return Slice(stats.tokens, stats.k3, stats.max_abs, _distance(pred, rollout), outside)


def locate(
    lm,
    history: WeightHistory,
    groups: Sequence[Any],
    max_samples: int = 16,
    max_tensor_samples: int = 2,
    budget_s: float = 60.0,
    tokenizer_dir: str | Path | None = None,
    precision: str = "fp32",
) -> MismatchReport | None:
    """The report for these groups, or None when no sample's versions are held by `history`.
    `tokenizer_dir` (the model's) enables the re-tokenized-history replay of multi-turn episodes;
    `precision` is the trainer's (its scorer's), so that the replays score as the trainer does."""
    samples = [
        s for s in samples_of(groups, max_samples) if all(history.get(v) is not None for v in set(s.versions))
    ]
    if not samples:
        return None
    hypotheses = _Hypotheses(_Scorer(lm, history, precision), samples)
    report = MismatchReport(
        tokens=len(hypotheses.rollout), k3=mismatch.mismatch_stats(hypotheses.base, hypotheses.rollout).k3
    )
    hypotheses.where(report)
    hypotheses.tags()  # needs no replay: named even when the logprobs agree
    if hypotheses.base_distance > 0:
        hypotheses.replays(tokenizer_dir, max_tensor_samples, budget_s)
    report.candidates = sorted(
        (Candidate(f, round(v, 4), e) for f, (v, e) in hypotheses.found.items()), key=lambda c: -c.score
    )
    return report


class _Hypotheses:
    """Each fault family's replays over the samples, scored against the engine's logprobs.

    Per-token lists run over every sample's model tokens in order (`owner[k]` = (sample, token))."""

    def __init__(self, scorer: _Scorer, samples: list[_Sample]) -> None:
        self.scorer, self.samples, self.history = scorer, samples, scorer.history
        self.owner = [(i, j) for i, s in enumerate(samples) for j in range(len(s.rollout))]
        self.first = {k for k, (_, j) in enumerate(self.owner) if j == 0}
        self.last = {k for k, (i, j) in enumerate(self.owner) if samples[i].is_last(j)}
        # The trainer's logits at each sample's own versions and one version older, one load per version.
        self.own: list[dict[int, torch.Tensor]] = [{} for _ in samples]
        wanted = {
            v - d for s in samples for v in s.versions for d in (0, 1) if self.history.get(v - d) is not None
        }
        for v in sorted(wanted):
            scorer.load(v)
            for i, s in enumerate(samples):
                if v in s.versions or v + 1 in s.versions:
                    self.own[i][v] = scorer.logits(s)
        self.rollout = self.assemble(lambda i, s: s.rollout)
        self.base = self.assemble(lambda i, s: self.at_own(i, s))
        self.base_distance = _distance(self.base, self.rollout)
        self.found: dict[str, tuple[float, str]] = {}
        self.starts = [s.starts for s in samples]  # per model token, where its turn starts
        self.episodes = any(len(set(x)) > 1 for x in self.starts)  # some sample has a later turn

    def where(self, report: MismatchReport) -> None:
        """The mismatch by position, worker, version, tag age and sampling setting."""
        samples = self.samples

        def table(key: Callable[[int, int], str]) -> dict[str, Slice]:
            groups: dict[str, list[int]] = {}
            for index, (i, j) in enumerate(self.owner):
                groups.setdefault(key(i, j), []).append(index)
            return {
                k: _slice([self.base[x] for x in xs], [self.rollout[x] for x in xs])
                for k, xs in sorted(groups.items())
            }

        def position(i: int, j: int) -> str:
            return "first" if j == 0 else "last" if samples[i].is_last(j) else "middle"

        report.by_position = table(position)
        report.by_worker = table(lambda i, j: samples[i].worker)
        report.by_version = table(lambda i, j: f"v{samples[i].versions[j]}")
        report.by_tag = table(
            lambda i, j: "newest" if samples[i].versions[j] == max(samples[i].versions) else "older"
        )
        report.by_sampling = table(lambda i, j: _describe(samples[i].transform))
        starts = self.starts
        if self.episodes:
            report.by_turn = table(
                lambda i, j: "first model turn" if starts[i][j] == 0 else "later model turns"
            )

    def assemble(self, per_sample: Callable[[int, _Sample], Sequence[float]]) -> list[float]:
        return [x for i, s in enumerate(self.samples) for x in per_sample(i, s)]

    def at_own(self, i: int, s: _Sample, transform=None, versions=None) -> list[float]:
        """Sample i's logprobs, each token at its version in `versions` (default: its own)."""
        versions = versions or s.versions
        per_version = {}
        for v in set(versions):
            if v not in self.own[i]:
                self.scorer.load(v)
                self.own[i][v] = self.scorer.logits(s)
            per_version[v] = _chosen(self.own[i][v], s, transform or s.transform)
        return [float(per_version[v][j]) for j, v in enumerate(versions)]

    def single_version(self, i: int, s: _Sample, logprobs: Callable[[torch.Tensor], Any]) -> list[float]:
        """`logprobs(logits)` at the sample's version where it has one; its own logprobs where not."""
        if len(set(s.versions)) > 1:
            return self.at_own(i, s)
        return logprobs(self.own[i][s.versions[0]]).tolist()

    def score(self, pred: list[float]) -> float:
        return max(0.0, 1.0 - _distance(pred, self.rollout) / self.base_distance)

    def replays(self, tokenizer_dir: str | Path | None, max_tensor_samples: int, budget_s: float) -> None:
        """Every family's replay, scored by the share of the mismatch it explains."""
        self.logprob_reporting()
        self.sampling_replay()
        self.penalties()
        self.versions()
        self.tensors(max_tensor_samples, budget_s)
        self.head()
        self.context()
        self.retokenized(tokenizer_dir)
        self.turn_versions()
        self.unreplayable()

    def tags(self) -> None:
        """Tags no engine produces (parity/versions.py `impossible_tags`), whatever the logprobs say.
        Where every dip to an older tag starts a later model turn of an episode, the likelier cause is
        an episode that kept an earlier turn's version (episode_version_tag); anywhere else, a span
        of tokens tagged wrong (wrong_version_tag)."""
        impossible = sum(impossible_tags(s.versions) for s in self.samples)
        if not impossible:
            return
        at_turn, elsewhere = 0, 0
        for i, s in enumerate(self.samples):
            for k in range(1, len(s.versions)):
                if s.versions[k] < s.versions[k - 1]:
                    if self.starts[i][k] == s.model_at[k]:  # k > 0: the first token of a later turn
                        at_turn += 1
                    else:
                        elsewhere += 1
        evidence = f"{impossible} tokens are tagged older than an earlier token of their sample"
        if at_turn and not elsewhere:
            turns = f"{evidence}, from the first token of {at_turn} later model turns"
            self.offer("episode_version_tag", 1.0, f"{turns}: the episode kept an earlier turn's version")
            self.offer("wrong_version_tag", 0.9, turns)
        else:
            self.offer("wrong_version_tag", 1.0, evidence)

    def offer(self, fault: str, value: float, evidence: str) -> None:
        if fault in FAULTS and value > self.found.get(fault, (-1.0, ""))[0]:
            self.found[fault] = (value, evidence)

    def mixed(self, other: list[float], where: Callable[[int], bool]) -> list[float]:
        """`other` at the tokens `where` names, the trainer's own elsewhere."""
        return [other[k] if where(k) else self.base[k] for k in range(len(self.base))]

    def logprob_reporting(self) -> None:
        raw = self.assemble(lambda i, s: self.single_version(i, s, lambda logits: _chosen(logits, s, None)))
        self.offer("raw_logprobs", self.score(raw), "the engine's logprobs equal the raw log-softmax")
        shifted = self.assemble(lambda i, s: _shift(self.at_own(i, s)))
        self.offer("logprobs_shifted", self.score(shifted), "token i carries token i+1's logprob")
        zeros = sum(self.rollout[k] == 0.0 and self.base[k] < 0 for k in self.last)
        last_share = self.score(self.mixed(self.rollout, lambda k: k in self.last))
        if self.last and zeros >= 0.9 * len(self.last):
            evidence = f"{zeros} of {len(self.last)} last-token logprobs are exactly 0"
            self.offer("last_logprob_dropped", last_share, evidence)
        else:
            self.offer("last_logprob_perturbed", last_share, "the mismatch is on each sample's last token")
        share_zero = zeros / max(1, len(self.last))
        self.offer("last_logprob_dropped", 0.5 * last_share * share_zero, "last-token logprobs read 0")

    def sampling_replay(self) -> None:
        """One grid over temperature, top-k and top-p, where the samples share one setting."""
        settings = sorted({s.transform for s in self.samples}, key=str)
        if len(settings) != 1:
            return
        requested = settings[0]
        best: dict[str, tuple[float, SamplingTransform | None]] = {}
        single = {"temperature": "temperature_replay", "top_k": "top_k_replay", "top_p": "top_p_replay"}
        for candidate in _transform_grid(requested):
            value = self.score(self.assemble(lambda i, s, c=candidate: self.at_own(i, s, transform=c)))
            changed = _differs(candidate, requested)
            fault = single[changed[0]] if len(changed) == 1 else "generation_config_leak"
            if len(changed) > 1:  # parsimony: several settings at once must explain clearly more
                value -= PARSIMONY
            if value > best.get(fault, (-1.0, None))[0]:
                best[fault] = (value, candidate)
        for fault, (value, candidate) in best.items():
            evidence = f"the engine sampled with {_describe(candidate)} (requested {_describe(requested)})"
            self.offer(fault, value, evidence)

    def penalties(self) -> None:
        for kind, fault, grid in (
            ("repetition", "repetition_penalty_unreplayed", (1.05, 1.1, 1.2, 1.3, 1.5, 2.0)),
            ("presence", "presence_penalty_unreplayed", (0.1, 0.25, 0.5, 1.0, 1.5, 2.0)),
        ):
            for value in grid:
                pred = self.assemble(
                    lambda i, s, k=kind, x=value: self.single_version(
                        i, s, lambda logits: _penalised_logprobs(logits, s, k, x)
                    )
                )
                self.offer(fault, self.score(pred), f"an unreplayed {kind} penalty of {value:g}")

    def versions(self) -> None:
        """Tags, and whole models one version older (every worker, one worker, first tokens)."""
        newest = self.assemble(lambda i, s: self.at_own(i, s, versions=[max(s.versions)] * len(s.versions)))
        evidence = "tokens tagged older than their sample match its newest weights"
        self.offer("wrong_version_tag", self.score(newest), evidence)

        def one_older(i: int, s: _Sample) -> list[float]:
            older = [max(0, v - 1) for v in s.versions]
            if any(self.history.get(v) is None for v in older):
                return self.at_own(i, s)
            return self.at_own(i, s, versions=older)

        older = self.assemble(one_older)
        evidence = "every worker's tokens match the weights one version older"
        self.offer("stale_weights", self.score(older), evidence)
        workers = sorted({s.worker for s in self.samples})
        for w in workers if len(workers) > 1 else []:
            pred = self.mixed(older, lambda k, w=w: self.samples[self.owner[k][0]].worker == w)
            self.offer(
                "one_worker_not_updated",
                self.score(pred),
                f"{w}'s tokens match the weights one version older",
            )
        first_old = self.mixed(older, lambda k: k in self.first)
        evidence = "each sample's first token matches the weights one version older"
        self.offer("async_first_token", self.score(first_old), evidence)

    def changed_weights(self, change: Callable[[dict], dict], key: Any, n: int) -> list[float]:
        """The first n samples' logprobs with `change` applied to every version's weights."""
        out = []
        for s in self.samples[:n]:
            per = {}
            for v in sorted(set(s.versions)):
                self.scorer.load(v, change, key)
                per[v] = _chosen(self.scorer.logits(s), s, s.transform)
            out += [float(per[v][j]) for j, v in enumerate(s.versions)]
        return out

    def score_on(self, pred: list[float], n: int) -> float:
        """The share explained over the first n samples' tokens."""
        count = sum(len(s.rollout) for s in self.samples[:n])
        reference = _distance(self.base[:count], self.rollout[:count])
        return max(0.0, 1.0 - _distance(pred, self.rollout[:count]) / reference) if reference > 0 else 0.0

    def tensors(self, max_tensor_samples: int, budget_s: float) -> None:
        """bf16 weights; one tensor at v-1 or two swapped: a hierarchical search within a time budget.
        Whole layers at v-1 first; then each tensor of the two layers that explain most (and the
        tensors outside layers); then every same-shaped pair within a layer swapped."""
        everything = len(self.samples)
        bf16 = self.changed_weights(_bf16, "bf16", everything)
        self.offer("bf16_weights", self.score(bf16), "the engine's weights are rounded to bf16")
        n = min(max_tensor_samples, everything)
        deadline = time.monotonic() + budget_s
        previous = self.history.get(max(0, max(self.samples[0].versions) - 1))
        skipped = 0

        def stale(names: list[str], key: Any) -> float:
            pred = self.changed_weights(lambda w: {**w, **{m: previous[m] for m in names}}, key, n)
            return self.score_on(pred, n)

        if previous is not None:
            layers: dict[str, list[str]] = {}
            outside: list[str] = []
            for name in self.scorer.params:
                (layers.setdefault(_layer_of(name), []) if _layer_of(name) else outside).append(name)
            ranked = sorted(layers, key=lambda layer: -stale(layers[layer], ("layer", layer)))
            for name in [*outside, *(m for layer in ranked[:2] for m in layers[layer])]:
                if time.monotonic() > deadline:
                    skipped += 1
                    continue
                self.offer(
                    "tensor_not_updated", stale([name], ("old", name)), f"{name} kept its previous value"
                )
        for a, b in _same_shaped_pairs(self.scorer.params):
            if time.monotonic() > deadline:
                skipped += 1
                continue
            pred = self.changed_weights(lambda w, x=a, y=b: {**w, x: w[y], y: w[x]}, ("swap", a, b), n)
            self.offer("swapped_tensors", self.score_on(pred, n), f"{a} and {b} swapped")
        if skipped:
            log.warning(
                "mismatch localisation: %d tensor hypotheses left out after %.0f s", skipped, budget_s
            )

    def head(self) -> None:
        """The head in bf16, or kept at v-1 while the (tied) input embeddings moved on."""
        head_bf16, untied = [], []
        embed_name = _input_embedding_name(self.scorer)
        tied = _tied(self.scorer.lm)
        for s in self.samples:
            v = s.versions[0]
            self.scorer.load(v)
            hidden, head = self.scorer.hidden_and_head(s)
            head_bf16 += _chosen((hidden.bfloat16() @ head.bfloat16().T).float(), s, s.transform).tolist()
            previous = self.history.get(max(0, v - 1))
            if previous is not None and embed_name in previous and tied:
                old_head = previous[embed_name].to(hidden.device).float()
                untied += _chosen(hidden @ old_head.T, s, s.transform).tolist()
        self.offer("bf16_lm_head", self.score(head_bf16), "the engine's head runs in bf16")
        if untied:
            evidence = "the engine's head kept older weights than its input embeddings"
            self.offer("untied_head", self.score(untied), evidence)

    def context(self) -> None:
        """RoPE theta, a left-truncated prompt, the prompt's KV from an older version."""
        import torch

        scorer = self.scorer
        rope = getattr(getattr(scorer.lm, "model", None), "rotary_emb", None)
        if rope is not None and hasattr(rope, "inv_freq"):
            original = rope.inv_freq.clone()
            for factor in (0.5, 2.0, 4.0, 10.0):
                with torch.no_grad():
                    rope.inv_freq.copy_(original * factor ** -_exponents(original))
                pred = self.assemble(lambda i, s: self.fresh(s, lambda: scorer.logits(s)))
                self.offer(
                    "rope_theta", self.score(pred), f"the engine's RoPE theta is {factor:g}x the trainer's"
                )
            with torch.no_grad():
                rope.inv_freq.copy_(original)
        truncated = []
        for keep in (0.25, 0.5, 0.75):

            def kept(s: _Sample, f: float = keep) -> list[int]:
                return s.prompt[len(s.prompt) - max(1, math.ceil(len(s.prompt) * f)) :]

            pred = self.assemble(lambda i, s, kept=kept: self.fresh(s, lambda: scorer.logits(s, kept(s))))
            truncated.append((self.score(pred), keep))
        value, fraction = max(truncated)
        self.offer("truncated_context", value, f"the engine saw only the last {fraction:.0%} of each prompt")
        for edit, what in PROMPT_EDITS:  # the template drifts a replay can rebuild
            pred = self.assemble(
                lambda i, s, e=edit: (
                    self.fresh(s, lambda: scorer.logits(s, e(s.prompt)))
                    if len(s.prompt) > 1
                    else self.at_own(i, s)
                )
            )
            self.offer(
                "prompt_token_drift", self.score(pred), f"the engine's prompts had their first token {what}"
            )
        self.stale_prefix()

    def stale_prefix(self) -> None:
        """The prompt's KV reused from an older version's forward: every held older version, and as
        many prompt tokens as a cache would hold (all but the last; or the prompts' shared prefix in
        whole KV blocks, which is all a hit across different prompts can cover)."""
        shared = _common_prefix([s.prompt for s in self.samples])
        held = self.history.versions()
        best: tuple[float, str] = (0.0, "")
        tried: set[tuple[int, ...]] = set()  # candidate lengths that coincide are replayed once
        for cached_of in (lambda s: len(s.prompt) - 1, *(_in_blocks(shared, b) for b in KV_BLOCKS)):
            lengths = tuple(cached_of(s) for s in self.samples)
            if lengths in tried:
                continue
            tried.add(lengths)
            for back in range(1, len(held)):
                pred: list[float] = []
                for i, s in enumerate(self.samples):
                    v, logits = s.versions[0], None
                    if len(set(s.versions)) == 1 and v - back in held:
                        logits = self.scorer.stale_prefix_logits(s, v, v - back, cached_of(s))
                    pred += (
                        _chosen(logits, s, s.transform).tolist() if logits is not None else self.at_own(i, s)
                    )
                value = self.score(pred)
                if value > best[0]:
                    tokens = sorted({cached_of(s) for s in self.samples})
                    span = f"{tokens[0]}" if len(tokens) == 1 else f"{tokens[0]}-{tokens[-1]}"
                    older = "one version" if back == 1 else f"{back} versions"
                    best = (
                        value,
                        f"the KV of the prompt's first {span} tokens matches the weights {older} older",
                    )
        self.offer("stale_prefix_kv", best[0], best[1] or "no older version's prompt KV explains it")

    def fresh(self, s: _Sample, logits: Callable[[], torch.Tensor]) -> list[float]:
        """The sample's logprobs from a new forward `logits()` at its (single) version; NaN per token
        where it has several (a changed model config is not replayed across a weight switch)."""
        if len(set(s.versions)) > 1:
            return [float("nan")] * len(s.versions)
        self.scorer.load(s.versions[0])
        return _chosen(logits(), s, s.transform).tolist()

    def retokenized(self, tokenizer_dir: str | Path | None) -> None:
        """Each later model turn of an episode conditioned on the round trip decode(encode(...)) of
        the episode's tokens before it, as a loop that keeps the conversation as text would have
        prompted the engine; the first turn at the trainer's own."""
        starts = self.starts
        if tokenizer_dir is None or not self.episodes:
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        scorer, torch, changed = self.scorer, self.scorer.torch, 0
        pred: list[float] = []
        for i, s in enumerate(self.samples):
            own = self.at_own(i, s)
            per_token = list(own)
            for ks in _later_turns(starts[i]):  # one forward per later turn, at its version
                start = starts[i][ks[0]]
                turn_versions = {s.versions[k] for k in ks}
                if len(turn_versions) > 1 or not scorer.load(turn_versions.pop()):
                    continue  # a turn across an update (or a version not held): its own logprobs
                end = s.model_at[ks[-1]] + 1
                history = s.completion[:start]
                text = tokenizer.decode(history, skip_special_tokens=False)
                again = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
                changed += again != history
                context = [*s.prompt, *again]
                ids = torch.tensor([[*context, *s.completion[start:end]]], device=scorer.device)
                logits = scorer.forward(ids)[0][len(context) - 1 : -1]
                lp = processed_logprobs(logits, s.transform)
                for k in ks:
                    at = s.model_at[k] - start
                    per_token[k] = float(lp[at, s.completion[s.model_at[k]]])
            pred += per_token
        evidence = (
            f"later model turns match their history re-tokenized from text ({changed} later turns had a "
            "changed history)"
        )
        self.offer("episode_retokenized", self.score(pred), evidence)

    def turn_versions(self) -> None:
        """Each later model turn at the held version, its tag's or newer, that explains it best, as
        when updates land between turns and the episode keeps its first turn's version for every
        token (how many landed is unknown: with a deep backlog a later turn can be several versions
        on; a turn no update preceded keeps its own)."""
        if not self.episodes:
            return
        held = self.history.versions()
        shifts: list[int] = []

        def newer_later_turns(i: int, s: _Sample) -> list[float]:
            out = self.at_own(i, s)
            for ks in _later_turns(self.starts[i]):
                tag, best = s.versions[ks[0]], None
                for v in (v for v in held if v >= tag):
                    pred = self.at_own(i, s, versions=[v] * len(s.versions))
                    d = _distance([pred[k] for k in ks], [s.rollout[k] for k in ks])
                    if best is None or d < best[0]:
                        best = (d, v, pred)
                if best is not None and best[1] > tag:
                    for k in ks:
                        out[k] = best[2][k]
                    shifts.append(best[1] - tag)
            return out

        pred = self.assemble(newer_later_turns)
        if not shifts:
            return
        if len(set(shifts)) > 1:
            ahead = f"{min(shifts)}-{max(shifts)} versions"
        else:
            ahead = "one version" if shifts[0] == 1 else f"{shifts[0]} versions"
        evidence = f"later model turns match the weights {ahead} newer than their tags"
        self.offer("episode_version_tag", self.score(pred), evidence)

    def unreplayable(self) -> None:
        """A fault with no replay scores by what nothing else explains."""
        explained = max((v for v, _ in self.found.values()), default=0.0)
        for fault in UNREPLAYABLE:
            evidence = "no replay explains it: the engine may have seen other prompt tokens than recorded"
            self.offer(fault, 0.5 * (1.0 - explained), evidence)


def _common_prefix(prompts: Sequence[list[int]]) -> int:
    """How many leading tokens every prompt shares."""
    n = min(len(p) for p in prompts)
    for k in range(n):
        if any(p[k] != prompts[0][k] for p in prompts):
            return k
    return n


def _in_blocks(shared: int, block: int) -> Callable[[_Sample], int]:
    """The prompt tokens a prefix cache of `block`-token blocks reuses from the `shared` prefix:
    whole blocks only, and never the prompt's last token (the engine computes at least one)."""
    return lambda s: (min(shared, len(s.prompt) - 1) // block) * block


def _exponents(inv_freq):
    """inv_freq = theta^-e: e per entry (so that theta * f gives inv_freq * f^-e)."""
    import torch

    n = inv_freq.numel()
    return torch.arange(0, 2 * n, 2, dtype=torch.float32, device=inv_freq.device) / (2 * n)


def _shift(values: list[float]) -> list[float]:
    return [*values[1:], values[-1]] if values else values


def _layer_of(name: str) -> str:
    """'model.layers.3' for 'model.layers.3.mlp.down_proj.weight'; '' outside the decoder layers."""
    head, sep, rest = name.partition(".layers.")
    return f"{head}.layers.{rest.split('.', 1)[0]}" if sep else ""


def _bf16(weights: dict) -> dict:
    return {k: v.bfloat16().to(v.dtype) if v.is_floating_point() else v for k, v in weights.items()}


def _same_shaped_pairs(params: dict) -> list[tuple[str, str]]:
    """Pairs of same-shaped matrices within one layer (names equal up to the last two parts)."""
    by_layer: dict[tuple, list[str]] = {}
    for name, p in params.items():
        if p.dim() == 2 and ".layers." in name:
            by_layer.setdefault((name.rsplit(".", 2)[0].rsplit(".", 1)[0], tuple(p.shape)), []).append(name)
    return [pair for names in by_layer.values() for pair in itertools.combinations(names, 2)]


def _input_embedding_name(scorer: _Scorer) -> str:
    embed = scorer.lm.get_input_embeddings().weight
    return next((n for n, p in scorer.params.items() if p is embed), "")


def _tied(lm) -> bool:
    return lm.get_output_embeddings().weight is lm.get_input_embeddings().weight


def _describe(t: SamplingTransform | None) -> str:
    if t is None:
        return "-"
    return f"temperature {t.temperature:g}, top_k {t.top_k}, top_p {t.top_p:g}"


def plot(report: MismatchReport, path: Path) -> Path:
    """Bars of k3 by position, worker and version, and the candidates' scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [("by position", report.by_position), ("by worker", report.by_worker),
              ("by weight version", report.by_version)]  # fmt: skip
    if report.by_turn:
        tables.append(("by model turn", report.by_turn))
    fig, axes = plt.subplots(1, len(tables) + 1, figsize=(4 * (len(tables) + 1), 3.6))
    for ax, (title, table) in zip(axes[:-1], tables, strict=True):
        names = list(table)
        values = [max(table[n].distance, 1e-12) for n in names]
        ax.bar(names, values, color="tab:red")
        ax.set_yscale("log")
        ax.set_title(f"mean |delta| {title}")
        ax.tick_params(axis="x", rotation=30)
    top = report.candidates[:8][::-1]
    axes[-1].barh([c.fault for c in top], [c.score for c in top], color="tab:blue")
    axes[-1].set_xlim(0, 1)
    axes[-1].set_title("share explained, by fault class")
    fig.suptitle(f"train-inference mismatch: k3 {report.k3:.2e} over {report.tokens} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
