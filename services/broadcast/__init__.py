"""services/broadcast: the WeightBroadcastService servicer and `parity serve broadcast`."""
