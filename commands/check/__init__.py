"""`parity check` and `parity compare`: rollout-vs-trainer mismatch, ablation, run overlays."""
