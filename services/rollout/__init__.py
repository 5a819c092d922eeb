"""services/rollout: the RolloutService servicer and `parity serve rollout`."""
