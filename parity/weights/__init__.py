"""The weight-sync data plane: how a version moves from the trainer (rank 0) to the rollout workers.

One publish/receive, in order (the broadcast service plans it; each step starts after the last):

    plan = broadcast.PublishVersion(v, describe(named))  # sender: names, shapes, WSUM64 per tensor
    staged = receive_and_verify(plan)   # worker: transfer into staging, checksum as buckets land
    if not staged.error:                # verified: every checksum matched the sender's
        pause(); swap(staged); resume() # generation stops only for the swap
    ack(v, staged.error)                # the sender's version becomes v once the service settles it

A failed or corrupted transfer leaves the receiver serving its old weights (nothing touches them
before the swap), and the sender's version unchanged: the same number is published again.

Map (file -> job):
    layout.py            the packed stream: dtypes, offsets, buckets, pack/unpack (TransferError)
    wire.py              TransferGroup: send/receive the stream over gloo (chain) or NCCL (broadcast)
    rendezvous.py        forming a group: hosted store, rendezvous fields, secret proof, GPU check
    group.py             GroupHolder: the one persistent group of a membership epoch
    devices.py           GPU identity (UUIDs) and free-memory checks before allocating
    verify.py            StreamVerifier: checksum each bucket as it lands
    checksum.py          WSUM64, the checksum itself; wsum_kernel.py/.c its compiled CPU kernel
    cuda_ipc.py          same-GPU handoff: export/map one packed CUDA buffer, no group
    sender.py            Publisher: the trainer's side (publish, retry, catch-up snapshots, IPC offer)
    receiver.py          receive_and_verify: a worker's side, into staging tensors
    membership_client.py a worker's registration and heartbeats with the broadcast service
    version_watch.py     version events from Redis pub/sub, caught up through gRPC
"""
