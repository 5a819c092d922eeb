"""The weight-broadcast control plane: version registry, membership, epochs, events, delta plans.

The gRPC face of it is services/broadcast."""
