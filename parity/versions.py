"""Weight versions: monotonic integers; version 0 is the initial checkpoint.

vLLM labels versions with strings and reports them as spans over output-token indexes; Parity keeps
one integer per token on the wire and converts with these helpers. Lag per token is
`trainer_version - token_version` and is never negative for a well-behaved pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def expand_spans(spans: Iterable[tuple[int, int, int]], num_tokens: int) -> list[int]:
    """(version, start, end) spans -> one version per token. Raises if they do not tile [0, n)."""
    versions: list[int] = []
    for version, start, end in spans:
        if start != len(versions) or end < start:
            raise ValueError(f"version spans do not tile the output: span ({version}, {start}, {end})")
        versions.extend([int(version)] * (end - start))
    if len(versions) != num_tokens:
        raise ValueError(f"version spans cover {len(versions)} tokens, output has {num_tokens}")
    return versions


def compress_versions(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    """One version per token -> contiguous (version, start, end) spans."""
    spans: list[tuple[int, int, int]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1][0] == version:
            spans[-1] = (version, spans[-1][1], i + 1)
        else:
            spans.append((int(version), i, i + 1))
    return spans


def parse_version_label(label: str | None) -> int:
    """vLLM's weight-version label -> int. vLLM starts at "default", which is Parity's version 0."""
    if label is None or label == "default":
        return 0
    return int(label)


def impossible_tags(weight_versions: Sequence[int], context_versions: Sequence[int] = ()) -> int:
    """Tokens of one sample whose tags no engine can produce: a weight version older than an earlier
    token's (an engine never serves an older version after a newer one, within a completion or
    across an episode's turns), or a context version newer than the token's own (its KV cannot
    come from weights newer than those that sampled it). Each token counts once."""
    count, newest = 0, None
    for j, version in enumerate(weight_versions):
        context = context_versions[j] if j < len(context_versions) else version
        if (newest is not None and version < newest) or context > version:
            count += 1
        newest = version if newest is None else max(newest, version)
    return count
