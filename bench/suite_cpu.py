"""CPU time of each test file, its services and engines included: a pytest plugin.

    PARITY_SUITE_CPU_OUT=/tmp/suite_cpu.jsonl bash scripts/test.sh -p bench.suite_cpu
    python -m bench.suite_cpu /tmp/suite_cpu.jsonl      # the files by CPU time, and the total

While a test file runs, its pytest worker (and so every process the file starts) sits in a cgroup of
its own, `/sys/fs/cgroup/cpuacct/parity-suite/<file>` (cgroup v1 cpuacct, root). A process killed
by a test, or one that outlives its parent, still counts; RUSAGE_CHILDREN would miss both. One line
per file: {"file", "tests", "wall_s", "cpu_s", "worker"}. Without a writable cpuacct hierarchy the
plugin says so and records nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct/parity-suite")
_current: dict = {}


def _join(name: str, reset: bool = False) -> Path:
    group = ROOT / name
    group.mkdir(parents=True, exist_ok=True)
    if reset:  # the group outlives the run: a later run of the same file starts from 0
        (group / "cpuacct.usage").write_text("0")
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def _finish() -> None:
    if not _current:
        return
    _join("between-files-" + os.environ.get("PYTEST_XDIST_WORKER", "main"))
    time.sleep(0.2)  # a process that is exiting still accrues
    cpu_s = int((_current["group"] / "cpuacct.usage").read_text()) / 1e9
    row = {
        "file": _current["file"],
        "tests": _current["tests"],
        "wall_s": round(time.monotonic() - _current["start"], 1),
        "cpu_s": round(cpu_s, 1),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(os.environ["PARITY_SUITE_CPU_OUT"], "a") as out:
        out.write(json.dumps(row) + "\n")
    _current.clear()


def pytest_configure(config: pytest.Config) -> None:
    if "PARITY_SUITE_CPU_OUT" not in os.environ:
        raise pytest.UsageError("bench.suite_cpu: set PARITY_SUITE_CPU_OUT to the JSONL file to write")
    if not os.access(ROOT.parent, os.W_OK):
        raise pytest.UsageError(f"bench.suite_cpu: {ROOT.parent} is not writable (cgroup v1 cpuacct, root)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    name = item.path.name
    if _current.get("file") != name:
        _finish()
        _current.update(
            file=name, group=_join(name.removesuffix(".py"), reset=True), start=time.monotonic(), tests=0
        )
    _current["tests"] += 1
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    _finish()


def main() -> None:
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: -r["cpu_s"])
    for r in rows:
        print(f"{r['file']:45s} {r['tests']:4d} tests  wall {r['wall_s']:7.1f} s  CPU {r['cpu_s']:7.1f} s")
    print(f"{len(rows)} files, {sum(r['cpu_s'] for r in rows):.0f} CPU-s")


if __name__ == "__main__":
    main()
