"""services/trainer: the TrainerService servicer and `parity serve trainer`."""
