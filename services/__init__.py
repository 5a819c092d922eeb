"""The gRPC face of the three services: rollout, trainer, broadcast (servicer + server bootstrap)."""
