"""The persistent data group of one membership epoch, as one rank holds it.

Invariants:
- One join per epoch, not per version: `GroupHolder.use(rdv)` yields the held group while plans
  name it, and joins the named group otherwise, closing the old one first.
- A group that raised is discarded, never reused: after a timeout or a dead peer, gloo and NCCL
  groups are not reusable, so the next plan (which names a new group) joins afresh.
- Groups named with `rendezvous.ONE_SHOT_PREFIX` (catch-up transfers) are joined and closed around
  one use and leave the held epoch group alone.
- One use at a time: `use` holds the holder's lock from the join to the end of the transfer.
"""

from __future__ import annotations

import threading

from parity.v1 import common_pb2
from parity.weights.rendezvous import ONE_SHOT_PREFIX
from parity.weights.wire import TransferGroup


class GroupHolder:
    """The data group of the current membership epoch (see the module docstring)."""

    def __init__(self) -> None:
        self.group: TransferGroup | None = None
        self.name = ""
        self._lock = threading.Lock()

    def use(self, rdv: common_pb2.Rendezvous) -> _HeldGroup:
        """`with holder.use(plan.rendezvous) as group:` the group to send or receive one version on."""
        return _HeldGroup(self, rdv)

    def _acquire(self, rdv: common_pb2.Rendezvous) -> TransferGroup:
        if rdv.group_name.startswith(ONE_SHOT_PREFIX):
            return TransferGroup.join(rdv)
        held = self.group
        same_rank = held is not None and (held.rank, held.world_size) == (rdv.rank, rdv.world_size)
        if same_rank and self.name == rdv.group_name:
            return held
        self.close()
        self.group, self.name = TransferGroup.join(rdv), rdv.group_name
        return self.group

    def close(self) -> None:
        """Tear the held group down (best effort, bounded by the group's own timeout)."""
        group, self.group, self.name = self.group, None, ""
        if group is not None:
            group.close()


class _HeldGroup:
    def __init__(self, holder: GroupHolder, rdv: common_pb2.Rendezvous) -> None:
        self.holder, self.rdv, self.group = holder, rdv, None

    def __enter__(self) -> TransferGroup:
        self.holder._lock.acquire()
        try:
            self.group = self.holder._acquire(self.rdv)
        except BaseException:
            self.holder._lock.release()
            raise
        return self.group

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.rdv.group_name.startswith(ONE_SHOT_PREFIX):
                self.group.close()
            elif exc_type is not None:
                self.holder.close()  # a group that failed is never reused
        finally:
            self.holder._lock.release()
