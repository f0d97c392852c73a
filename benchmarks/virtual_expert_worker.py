"""The expert arm of benchmarks/headline.py on a virtual pair: stock vLLM (``mp`` backend, no
dualgpu executor) with both pipeline ranks on physical GPU 0.

vLLM's ``--device-ids`` refuses a repeated id, so this worker class (``worker_cls``) sets, in each
worker process before its device is initialised:

- ``ParallelConfig.assigned_physical_gpu_ids = [0, 0]``: vLLM's GPU worker maps its local rank
  through that list (``init_device``), so rank 1 takes cuda:0 too (with CUDA_VISIBLE_DEVICES=0);
- ``NCCL_HOSTID`` distinct per rank (and ``NCCL_SOCKET_IFNAME=lo`` unless set): NCCL refuses two
  ranks on one device of one host; as two "hosts" they talk over sockets on the loopback.

Nothing else changes: the expert's split, block count and KV bytes are its own flags, and no
rank is held to its card's size (only the plugin does that); headline.py compares each rank's
measured peak with its card afterwards.
"""

from __future__ import annotations

import os
import socket

from vllm.v1.worker.gpu_worker import Worker


def same_gpu_env(rank: int) -> dict:
    """What one rank's process needs to share GPU 0 with the others (set before NCCL starts)."""
    return {"NCCL_HOSTID": f"{socket.gethostname()}-expert-virtual-{rank}",
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}


class VirtualPairExpertWorker(Worker):
    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False, **kwargs):
        pc = vllm_config.parallel_config
        pc.assigned_physical_gpu_ids = [0] * pc.world_size
        os.environ.update(same_gpu_env(rank))
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker, **kwargs)
