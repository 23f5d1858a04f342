"""SEQUENCE_PARALLEL with a real TP group: torch.distributed processes (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_ops import BatchLayout, capture_routing

POISON = -7


def _worker(rank: int, world: int, init_file: str, backend: str, result_dir: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(1234)  # every rank builds the same full batch
        failures = []
        for c in (0, 1, 5, 7, 12):
            padded = c + 3
            per = -(-padded // world)  # ceil(padded / tp): the shard each TP rank holds
            full = torch.full((per * world, 4), -99, dtype=torch.int32)
            full[:c] = torch.randint(0, 128, (c, 4), generator=g, dtype=torch.int32)
            mine = full[rank * per : (rank + 1) * per].to(device)
            counts = torch.tensor([c], dtype=torch.int32, device=device)

            buffer = torch.full((16, 3, 4), POISON, dtype=torch.int32, device=device)
            capture_routing(
                buffer,
                mine,
                2,
                token_counts=counts,
                layout=BatchLayout.SEQUENCE_PARALLEL,
                tp_group=dist.group.WORLD,
            )
            expected = torch.full((16, 3, 4), POISON, dtype=torch.int32)
            expected[:c, 2] = full[:c]
            if not torch.equal(buffer.cpu(), expected):
                failures.append(f"eager c={c}")

            def step(buf, ids, cnt):
                capture_routing(
                    buf,
                    ids,
                    2,
                    token_counts=cnt,
                    layout=BatchLayout.SEQUENCE_PARALLEL,
                    tp_group=dist.group.WORLD,
                )

            buffer.fill_(POISON)
            torch.compile(step, fullgraph=True, dynamic=False)(buffer, mine, counts)
            if not torch.equal(buffer.cpu(), expected):
                failures.append(f"compiled c={c}")
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(";".join(failures) if failures else "ok")
    finally:
        dist.destroy_process_group()


def _run(world: int, backend: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file, backend, tmp), nprocs=world, join=True)
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}")) as f:
                assert f.read() == "ok", f"rank {rank} of {world}"


@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel_gloo(world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    _run(world, "gloo")


@pytest.mark.gpu
def test_sequence_parallel_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for an NCCL TP group, found {torch.cuda.device_count()}")
    _run(2, "nccl")
