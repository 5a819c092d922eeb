"""A stand-in trainer: publishes toy weight versions with the real `parity.weights.sender.Publisher`
(rank 0 of the epoch's data group, catch-up thread included), without a model or an optimizer.
The chaos tests run it as a process they can kill mid-transfer.

    PARITY_AUTH_TOKEN=... python -m tests.fakes.fake_trainer --broadcast_address HOST:PORT --versions 1,2

It prints one JSON line per version: {"version", "ok", "error"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

MODEL = "toy"
BUCKET_BYTES = 256 * 1024


def toy_weights(version: int) -> list[tuple[str, object]]:
    """About 1.2 MB over four tensors, two dtypes; different values per version."""
    import torch

    gen = torch.Generator().manual_seed(1000 + version)
    return [
        ("embed.weight", torch.randn(1000, 256, generator=gen)),
        ("layers.0.w", torch.randn(256, 256, generator=gen).to(torch.bfloat16)),
        ("norm.weight", torch.randn(256, generator=gen)),
        ("head.bias", torch.randn(1000, generator=gen)),
    ]


def trainer_checksums(version: int) -> list[str]:
    from parity.weights import checksum

    return [str(m.checksum) for m in checksum.describe(toy_weights(version))]


def main(argv: Sequence[str] | None = None) -> int:
    from parity.weights.sender import Publisher, PublishError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broadcast_address", required=True)
    parser.add_argument("--versions", required=True, help="comma-separated versions to publish in order")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    publisher = Publisher(
        args.broadcast_address,
        MODEL,
        auth_token=os.environ.get("PARITY_AUTH_TOKEN", ""),
        bucket_bytes=BUCKET_BYTES,
    )
    for version in (int(v) for v in args.versions.split(",")):
        try:
            publisher.publish_tensors(toy_weights(version), version)
            print(json.dumps({"version": version, "ok": True, "error": ""}), flush=True)
        except PublishError as exc:
            print(json.dumps({"version": version, "ok": False, "error": str(exc)}), flush=True)
    publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
