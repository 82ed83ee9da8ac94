"""FSDP2 (``fully_shard``) under a budget: 2 gloo processes, one budget per rank.

Each rank trains an MLP sharded per block and at the root, one session per step, optimizer
included. While a block runs, forward or backward, the engine counts exactly the bytes FSDP
holds all-gathered (the blocks gathered, none of those FSDP freed); under 0.6 of its
unconstrained peak a rank evicts and recomputes, and its gradients and updated parameters
equal those of an unconstrained FSDP model trained beside it from the same initial state.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_runtime_ddp import on_two_ranks
from torch import nn

BATCH, STEPS = 1024, 2


def _sharded(mesh: object) -> nn.Sequential:
    """Four blocks and a head, each block an FSDP unit and the root one more."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                            nn.Linear(256, 64)) for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Linear(64, 10))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _gathered_bytes(model: nn.Module, session: object, storages: dict) -> tuple[int, int]:
    """The bytes FSDP holds now in the storages of its all-gathered parameters (a module's
    parameters are plain tensors while gathered, DTensor shards otherwise; FSDP frees and
    reallocates the same storages: ``storages`` keeps every one seen so far), and what the
    engine counts of them."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if not isinstance(p, DTensor):
            storages[p.untyped_storage()._cdata] = p.untyped_storage()
    bases = session.leaves.bases
    return (sum(st.nbytes() for st in storages.values()),
            sum(bases[w].storage.nbytes for w in storages if w in bases))


def _watch(model: nn.Sequential, active: dict, seen: list) -> None:
    """Compare held and counted bytes as each block starts its forward and its backward."""
    storages: dict = {}

    def check(*_: object) -> None:
        if "session" in active:
            seen.append(_gathered_bytes(model, active["session"], storages))

    def backward_too(_: nn.Module, __: object, out: torch.Tensor) -> None:
        out.register_hook(check)  # runs after FSDP's: the block is gathered again

    for block in list(model)[:-1]:
        block.register_forward_pre_hook(check)  # runs after FSDP's all-gather
        block.register_forward_hook(backward_too)


def _worker(rank: int, world: int, port: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import membudget

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model, plain = _sharded(mesh), _sharded(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        active: dict = {}
        seen: list[tuple[int, int]] = []
        _watch(model, active, seen)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(BATCH, 64, generator=gen)
        y = torch.randint(0, 10, (BATCH,), generator=gen)

        def step(net: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            grads = [p.grad.to_local().clone() for p in net.parameters()]
            optimizer.step()
            return grads

        def budgeted(nbytes: int) -> tuple[list[torch.Tensor], object]:
            with membudget.budget(nbytes, "dtr") as session:
                active["session"] = session
                grads = step(model, opt)
            del active["session"]
            return grads, session.stats

        grads, free = budgeted(10**9)  # the optimizer's first step makes its state
        step(plain, plain_opt)
        grads, free = budgeted(10**9)
        plain_grads = step(plain, plain_opt)
        budget = free.peak_bytes * 7 // 10
        steps = [(free.evictions, free.peak_bytes <= budget,
                  all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True)))]
        for _ in range(STEPS):
            plain_grads = step(plain, plain_opt)
            grads, stats = budgeted(budget)
            steps.append((min(stats.evictions, stats.remat_ops), stats.peak_bytes <= budget,
                          all(torch.equal(a, b) for a, b in zip(grads, plain_grads,
                                                                strict=True))))
        same = all(torch.equal(a.to_local(), b.to_local())
                   for a, b in zip(model.parameters(), plain.parameters(), strict=True))
        unit = sum(p.numel() * p.element_size() for p in model[0].parameters())
        results[rank] = (steps, same, seen, unit,
                         all(isinstance(p, DTensor) for p in model.parameters()))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not built")
def test_fsdp_counts_gathered_parameters_and_matches_unconstrained_fsdp():
    got = on_two_ranks(_worker)
    for steps, same, seen, unit, sharded in got.values():
        (free_evictions, _, free_equal), *budgeted = steps
        assert free_evictions == 0 and free_equal
        assert all(moved > 0 and within and equal for moved, within, equal in budgeted)
        assert same and sharded  # the same updates; FSDP's parameters sharded again
        # forward and backward of 4 blocks, each of 4 sessions
        assert len(seen) == 4 * 2 * 4
        assert all(counted == held for held, counted in seen)
        # a block's full parameters, and the head's (never freed between blocks), counted
        assert all(held >= unit for held, _ in seen)
        assert max(held for held, _ in seen) < 3 * unit  # and not every block's


def test_a_leaf_resized_in_place_is_counted_as_it_is_and_never_read_while_freed():
    """What FSDP does to an all-gathered parameter, in one process: its storage freed and
    reallocated in place, by no op. The engine counts its bytes only while it holds them, and
    a recomputation that needs it runs once it is back, and fails loudly while it is not."""
    from torch.utils._python_dispatch import _disable_current_modes

    import membudget
    from membudget.errors import MembudgetError
    from membudget.runtime.session import Session

    w, x = torch.randn(64, 64), torch.randn(64, 64)
    expected, saved, nbytes = x @ w, w.clone(), w.untyped_storage().nbytes()

    def evict_and_free(session: Session) -> tuple[torch.Tensor, int]:
        y = x @ w
        used = session.engine.used_bytes
        assert session.evict(y)
        w.untyped_storage().resize_(0)  # FSDP's reshard
        session.leaves.resized(w)
        assert session.engine.used_bytes == used - 2 * nbytes  # y evicted, w freed
        return y, used

    with membudget.budget(10**8, "dtr") as session:
        y, used = evict_and_free(session)
        w.untyped_storage().resize_(nbytes)  # its next all-gather
        with _disable_current_modes():
            w.copy_(saved)
        session.leaves.resized(w)
        assert session.engine.used_bytes == used - nbytes
        assert torch.equal(y.value(), expected)
    with membudget.budget(10**8, "dtr") as session:
        y, _ = evict_and_free(session)
        with pytest.raises(MembudgetError, match="freed"):
            y.sum()
        del y
    w.untyped_storage().resize_(nbytes)
