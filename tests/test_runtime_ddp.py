"""DistributedDataParallel under a budget: 2 gloo processes, one budget per rank.

DDP rebuilds its gradient buckets in C++ on the second forward, reading raw tensor data; that
iteration must run outside a budget (a wrapper has no data of its own to read). After it,
every rank's gradients under half its unconstrained peak equal an unconstrained DDP step.
"""

from __future__ import annotations

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


def _worker(rank: int, world: int, port: int, results: dict) -> None:
    import membudget

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(32, 128)]
        for _ in range(8):
            layers += [nn.ReLU(), nn.Linear(128, 128)]
        model = nn.Sequential(*layers, nn.Linear(128, 10))
        ddp = nn.parallel.DistributedDataParallel(model)
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(1024, 32, generator=gen), torch.randint(0, 10, (1024,), generator=gen)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()

        step()  # the bucket rebuild happens on the next forward: outside any budget
        step()
        ref = [p.grad.clone() for p in model.parameters()]
        with membudget.budget(10**9, "dtr") as free:
            step()
        budget = free.stats.peak_bytes // 2
        with membudget.budget(budget, "dtr") as session:
            step()
        results[rank] = (
            all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref, strict=True)),
            session.stats.evictions, session.stats.peak_bytes <= budget)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_ddp_gradients_equal_an_unconstrained_ddp_step():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(2, _free_port(), results), nprocs=2)
        got = dict(results)
    assert sorted(got) == [0, 1]
    for equal, evictions, within in got.values():
        assert equal and within and evictions > 0
