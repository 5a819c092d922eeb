"""Subscriber-side CPU per pub/sub message: how parity/weights/version_watch.py reads its subscription.

    .venv/bin/python bench/pubsub_read.py [--subscribers 500] [--messages 20]

N redis-py asyncio subscribers in this one process (a private redis-server), one message published
at a time; each variant gets the same messages in the same run:
- `deadline_resp3`: `get_message(timeout=30)` per message, RESP3 (redis-py 8's default protocol):
  how the watch read before (a timer in the event loop's heap per read);
- `deadline_resp2`: the same with RESP2;
- `blocking_resp2`: `get_message(timeout=None)`, RESP2: how the watch reads now (its watchdog, one
  sleep per resync_s, is not on this path);
- `blocking_resp3`: the same with RESP3.
Reported per variant: this process's CPU per subscriber per message (us; the publisher's share is
the same in every variant), the p50 and max time from PUBLISH to the last subscriber, and the ratio
of each variant's CPU to `deadline_resp3`'s. Final stdout line: a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "deadline_resp3": (30.0, 3),
    "deadline_resp2": (30.0, 2),
    "blocking_resp2": (None, 2),
    "blocking_resp3": (None, 3),
}


async def measure(url: str, subscribers: int, messages: int, timeout: float | None, protocol: int) -> dict:
    import redis.asyncio as aioredis

    got: dict[bytes, list[float]] = {}
    ready: list[int] = []
    channel = f"bench-{protocol}-{timeout}"

    async def subscriber() -> None:
        client = aioredis.from_url(url, protocol=protocol)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(channel)
        ready.append(1)
        try:
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
                if message and message["type"] == "message":
                    got.setdefault(message["data"], []).append(time.monotonic())
        finally:
            await pubsub.aclose()
            await client.aclose()

    tasks = [asyncio.ensure_future(subscriber()) for _ in range(subscribers)]
    deadline = time.monotonic() + 60
    while len(ready) < subscribers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ready)}/{subscribers} subscribed in 60 s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    publisher = aioredis.from_url(url)
    latencies, cpu = [], 0.0
    for k in range(messages):
        key = f"m{k}".encode()
        cpu0, sent = time.process_time(), time.monotonic()
        await publisher.publish(channel, key)
        while len(got.get(key, [])) < subscribers:
            if time.monotonic() - sent > 30:
                raise TimeoutError(f"message {k}: {len(got.get(key, []))}/{subscribers} in 30 s")
            await asyncio.sleep(0.001)
        cpu += time.process_time() - cpu0
        latencies.append((max(got[key]) - sent) * 1e3)
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await publisher.aclose()
    latencies.sort()
    return {
        "cpu_us_per_subscriber_message": cpu / messages / subscribers * 1e6,
        "ms_p50": latencies[len(latencies) // 2],
        "ms_max": latencies[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--subscribers", type=int, default=500)
    parser.add_argument("--messages", type=int, default=20)
    args = parser.parse_args()
    from redis.utils import HIREDIS_AVAILABLE

    from parity.procs import start_redis

    out: dict = {"subscribers": args.subscribers, "messages": args.messages, "hiredis": HIREDIS_AVAILABLE}
    with tempfile.TemporaryDirectory(prefix="parity-pubsub-") as tmp:
        redis_proc, url = start_redis(tmp)
        try:
            for name, (timeout, protocol) in VARIANTS.items():
                out[name] = asyncio.run(measure(url, args.subscribers, args.messages, timeout, protocol))
                print(f"[pubsub_read] {name}: {json.dumps(out[name])}", flush=True)
        finally:
            redis_proc.stop(5.0)
    base = out["deadline_resp3"]["cpu_us_per_subscriber_message"]
    for name in VARIANTS:
        out[name]["cpu_ratio_vs_deadline_resp3"] = out[name]["cpu_us_per_subscriber_message"] / base
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
