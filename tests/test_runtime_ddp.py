"""DistributedDataParallel under a budget: 2 gloo processes, one budget per rank.

Every step runs inside a budget from DDP's first forward: its second forward rebuilds the
gradient buckets inside a session (membudget.runtime.ddp), and its BatchNorm buffers are
broadcast there (a collective: its outputs are pinned). Each rank's gradients under 0.6 of its
unconstrained peak equal those of an unconstrained DDP step.
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_two_ranks(worker) -> dict:
    """Run ``worker(rank, world, port, results)`` in 2 processes; their results by rank."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(2, _free_port(), results), nprocs=2)
        got = dict(results)
    assert sorted(got) == [0, 1]
    return got


def _worker(rank: int, world: int, port: int, results: dict) -> None:
    import membudget

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(32, 128), nn.BatchNorm1d(128)]
        for _ in range(8):
            layers += [nn.ReLU(), nn.Linear(128, 128)]
        model = nn.Sequential(*layers, nn.Linear(128, 10))
        plain = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        plain_ddp = nn.parallel.DistributedDataParallel(plain)
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(1024, 32, generator=gen), torch.randint(0, 10, (1024,), generator=gen)

        def step(net: nn.Module, wrapper: nn.Module) -> list[torch.Tensor]:
            net.zero_grad(set_to_none=True)
            F.cross_entropy(wrapper(x), y).backward()
            return [p.grad.clone() for p in net.parameters()]

        with membudget.budget(10**9, "dtr") as free:  # DDP's first forward and backward
            step(model, ddp)
        step(plain, plain_ddp)  # the same number of steps: the same BatchNorm statistics
        budget = free.stats.peak_bytes * 3 // 5
        equal, evictions, within = [], [], []
        for _ in range(2):  # the first one rebuilds the buckets
            ref = step(plain, plain_ddp)
            with membudget.budget(budget, "dtr") as session:
                got = step(model, ddp)
            equal.append(all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)))
            evictions.append(session.stats.evictions)
            within.append(session.stats.peak_bytes <= budget)
        results[rank] = (equal, evictions, within, ddp._has_rebuilt_buckets,
                         torch.equal(model[1].running_mean, plain[1].running_mean))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_ddp_gradients_equal_an_unconstrained_ddp_step():
    got = on_two_ranks(_worker)
    for equal, evictions, within, rebuilt, same_stats in got.values():
        assert equal == [True, True] and within == [True, True] and min(evictions) > 0
        assert rebuilt and same_stats
