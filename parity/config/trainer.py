"""The `trainer` section (`--trainer.lr 3e-5`, `PARITY_TRAINER_LR`); shared values are in `run`/`model`.

Invariants checked at startup (a bad value fails with the field named):
- IS corrections are off by default (`is_correction=none`) and need `is_cap > 1` when on;
- `max_lag >= 0`: entries whose oldest token is more than `max_lag` versions behind are dropped.
- `precision=bf16` keeps float32 master weights, so it needs `dtype=float32`.
- `nproc > 1` (data parallel under torchrun) does not support `old_logprobs=recompute` (the per-version
  rescoring would run a different number of sharded forwards on each rank).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from parity.config.base import DEFAULT_BUCKET_BYTES, ServiceConfig, check_address

Objective = Literal["grpo", "ppo", "gspo"]
LossAgg = Literal["token", "sequence"]
IsCorrection = Literal["none", "tis", "mis"]
IsLevel = Literal["token", "sequence"]
AfterLastStep = Literal["exit", "serve"]
OldLogprobs = Literal["behaviour", "recompute"]


class TrainerConfig(ServiceConfig):
    """The trainer service: `parity serve trainer --field value` (its own fields need no prefix)."""

    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter dtype; the lm_head is always computed in float32."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when available (cuda:LOCAL_RANK under torchrun), else CPU."
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="fp32: everything float32 (parity checks). bf16: bf16 decoder compute over fp32 master "
        "weights and fp32 AdamW state, as a bf16 engine computes; the lm_head multiplies the bf16 copy of "
        "its weight into float32 logits (as a bf16 engine's fp32 head does), and the log-softmax is fp32.",
    )
    dist_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Timeout of every collective between trainer ranks (FSDP2 under torchrun: the "
        "rank count comes from WORLD_SIZE).",
    )
    nproc: int = Field(
        1,
        ge=1,
        le=1024,
        description="Trainer ranks on this host (FSDP2 data parallel). Above 1, `parity serve trainer` "
        "re-launches itself under torchrun with this many processes (one GPU each, or gloo on CPU): rank 0 "
        "serves gRPC, reads Redis and publishes; the other ranks get their share of each batch from it.",
    )
    packing: bool = Field(
        True,
        description="Pack each micro-batch's sequences into one row (position ids restart per sequence, "
        "attention stays inside each): no padding. false = right-padded micro-batches.",
    )
    share_prompts: bool = Field(
        True,
        description="With packing: a micro-batch writes a prompt its sequences share (a GRPO group's) once, "
        "and each sequence's completion attends to it; the prompt goes through the model once instead of "
        "once per sample. Logprobs equal each sequence alone's.",
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="Token budget per micro-batch: real tokens when packing, padded tokens (sequences x "
        "longest) otherwise; 0 = micro_batch_size alone decides. Unpacked, sequences are grouped by "
        "length so that micro-batches pad little.",
    )
    head_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Tokens whose float32 head logits are alive at once: the head scores the sampled "
        "tokens chunk by chunk and keeps no [tokens, vocab] logits for backward; 0 = a micro-batch at once.",
    )
    head_grad_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype of the head's backward GEMMs (never of the logprobs, which are float32): "
        "auto = bfloat16 with precision bf16 on CUDA (tensor cores), else float32.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward (less memory)."
    )
    compile: Literal["off", "inductor", "aot_eager"] = Field(
        "off",
        description="torch.compile each decoder layer's forward (dynamic shapes; the packed attention and "
        "the float32 head stay eager): inductor generates fused kernels, aot_eager only captures the "
        "graphs (for debugging). The first micro-batches pay the compile time. Inductor's logprobs are not "
        "bitwise eager's (fused kernels round differently) but as close to exact.",
    )
    dedupe_window: int = Field(
        100_000,
        ge=0,
        description="Rollout ids kept in each checkpoint to skip a producer's late duplicates, besides "
        "the ids of entries at or above the replay floor (which are always kept).",
    )
    consumer_group: str = Field("trainer", description="Redis consumer group name.")
    consumer_name: str = Field(
        "trainer-0", description="Consumer name in the group; stable across restarts of the same trainer."
    )
    stream_maxlen: int = Field(
        10_000, gt=0, description="Stream length above which acked history is trimmed."
    )
    claim_idle_ms: int = Field(
        30_000, ge=0, description="Claim entries pending on another consumer idle this long (XAUTOCLAIM)."
    )
    read_block_ms: int = Field(
        500, gt=0, le=20_000, description="XREADGROUP BLOCK per read while waiting for rollouts."
    )
    broadcast_address: str = Field(
        "", description="host:port of the weight-broadcast service; empty publishes versions locally only."
    )
    run_dir: str = Field("runs/trainer", description="Directory for metrics.jsonl, checkpoints and logs.")
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per forward/backward; gradients accumulate over micro-batches."
    )
    objective: Objective = Field("grpo", description="grpo | ppo (baseline-only advantages) | gspo.")
    loss_agg: LossAgg = Field("token", description="token: mean over all tokens; sequence: mean of means.")
    lr: float = Field(3e-5, gt=0, le=1.0, description="AdamW learning rate.")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up over this many optimizer steps; 0 = constant."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    clip_eps_low: float = Field(0.2, gt=0, description="PPO/GRPO ratio clip below 1 (1 - eps).")
    clip_eps_high: float = Field(0.2, gt=0, description="PPO/GRPO ratio clip above 1 (1 + eps).")
    gspo_clip_eps_low: float = Field(3e-4, gt=0, description="GSPO sequence-ratio clip below 1.")
    gspo_clip_eps_high: float = Field(4e-4, gt=0, description="GSPO sequence-ratio clip above 1.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL penalty to the initial policy.")
    is_correction: IsCorrection = Field("none", description="Off-policy correction: none | tis | mis.")
    is_level: IsLevel = Field("token", description="IS weights per token or per sequence.")
    is_cap: float = Field(2.0, gt=0, description="TIS truncation / MIS mask threshold on the IS weight.")
    old_logprobs: OldLogprobs = Field(
        "behaviour",
        description="PPO old policy: behaviour = rollout logprobs; recompute = trainer at the rollout's "
        "version (keeps max(max_lag+1, 2) weight snapshots, one extra no-grad forward per version per micro-batch, over the sequences holding it).",
    )
    own_version_groups: int = Field(
        1,
        ge=0,
        description="Backend mismatch at each token's own version, every step: rescore this many groups "
        "with stale tokens under the weights that sampled them (keeps max(max_lag+1, 2) weight snapshots: "
        "the gate's localisation replays one version back; on the "
        "host when training on CUDA); lag-0 tokens are always measured. 0 turns it off.",
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Checkpoint every N steps; 0 = only at the end/on request."
    )
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept on disk (oldest removed).")
    bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, gt=0, description="Transfer bucket size for publishing.")
    wait_committed_s: float = Field(
        30.0, ge=0, description="Wait this long for the broadcast to commit each version; 0 skips waiting."
    )
    await_workers: int = Field(
        0,
        ge=0,
        le=1024,
        description="After its last step, keep serving catch-ups until this many rollout workers hold the "
        "final version (up to await_workers_timeout_s), then exit. `parity run` sets it to "
        "run.rollout_workers: a resumed trainer can train its last steps from the stream before the "
        "rollout services have caught up, and only it can send them the weights. 0 = do not wait.",
    )
    await_workers_timeout_s: float = Field(
        300.0, gt=0, description="How long await_workers waits; then the trainer exits anyway (logged)."
    )
    after_last_step: AfterLastStep = Field(
        "exit",
        description="exit: exit 0 once the last step is published and checkpointed (and await_workers "
        "is met). serve: then keep serving (health SERVING, GetStatus with finished true, catch-ups of "
        "the final version for rollout services that restart) until SIGTERM, for an orchestrator that "
        "restarts a container that exits 0 (a Kubernetes StatefulSet). A trainer started on a finished "
        "run trains and writes nothing either way.",
    )
    torch_threads: int = Field(0, ge=0, description="torch.set_num_threads; 0 leaves the default.")
    freeze: str = Field(
        "",
        description="Comma-separated fnmatch patterns of parameter names (e.g. 'model.embed_tokens.*,"
        "model.layers.[0-3].*') that are not trained: no gradient, no optimizer state, unchanged in every "
        "published version (with broadcast.delta_updates their bytes are not resent). Each pattern "
        "must match a parameter.",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="Stop the run (exit 1) after this many steps in a row whose gradient norm is not "
        "finite; each such step is skipped and its rollouts dropped and recorded (skipped_rollouts.jsonl).",
    )
    publish_attempts: int = Field(
        4,
        ge=1,
        description="Attempts to publish a version (a failed transfer is retried) before the run stops.",
    )
    publish_backoff_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Wait before the first publish retry; doubled after each further failure, capped at 30 s.",
    )

    @field_validator("broadcast_address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)

    @model_validator(mode="after")
    def _precision(self) -> TrainerConfig:
        if self.precision == "bf16" and self.dtype != "float32":
            raise ValueError("precision: bf16 keeps float32 master weights; it needs dtype=float32")
        return self

    @model_validator(mode="after")
    def _nproc(self) -> TrainerConfig:
        if self.nproc > 1 and self.old_logprobs == "recompute":
            raise ValueError(
                "nproc: old_logprobs=recompute is not supported with more than one trainer rank "
                f"(got nproc={self.nproc}); use old_logprobs=behaviour or nproc=1"
            )
        return self

    @model_validator(mode="after")
    def _is_cap(self) -> TrainerConfig:
        if self.is_correction != "none" and self.is_cap <= 1.0:
            raise ValueError(
                f"is_cap: must be > 1 when is_correction={self.is_correction} (got {self.is_cap})"
            )
        return self

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) for the chosen objective."""
        if self.objective == "gspo":
            return self.gspo_clip_eps_low, self.gspo_clip_eps_high
        return self.clip_eps_low, self.clip_eps_high
