"""`parity run`: launcher, supervisor, held-out evaluation, plots."""
