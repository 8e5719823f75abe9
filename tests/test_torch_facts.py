"""Facts the handbook states about PyTorch itself, checked against the installed torch.

These are claims about the framework, not the package, so they test torch directly: a
torch upgrade that changes one of them fails here before the page goes stale.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler


def test_batchnorm_depends_on_the_batch_only_in_train_mode() -> None:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    sample, others = torch.randn(1, 4), torch.randn(7, 4) * 3 + 1
    norm.train()
    norm(torch.randn(64, 4))  # some running statistics to evaluate with
    alone_train = norm(torch.cat([sample, sample]))[0]  # train mode needs > 1 value per channel
    batched_train = norm(torch.cat([sample, others]))[0]
    assert not torch.allclose(alone_train, batched_train), "train mode: the batch changes the output"
    norm.eval()
    assert torch.equal(norm(sample)[0], norm(torch.cat([sample, others]))[0]), "eval mode: it does not"


def test_adamw_fp32_step_reads_16_and_writes_12_bytes_per_parameter() -> None:
    """Reads: every tensor whose value changes the update. Writes: every tensor the step changes."""
    def stepped(perturb: str | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        param = nn.Parameter(torch.randn(1000))
        opt = torch.optim.AdamW([param], lr=1e-2)
        for _ in range(2):  # the first step creates the moments; measure the second
            param.grad = torch.randn(1000)
            if _ == 1:
                state = opt.state[param]
                tensors = {"param": param.data, "grad": param.grad,
                           "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
                before = {k: v.clone() for k, v in tensors.items()}
                if perturb:
                    tensors[perturb].add_(1e-3)
            opt.step()
        return {"before": before, "after": {k: v.clone() for k, v in tensors.items()}}

    base = stepped(None)
    written = {k for k in base["before"] if not torch.equal(base["before"][k], base["after"][k])}
    read = {k for k in base["before"]
            if not torch.equal(stepped(k)["after"]["param"], base["after"]["param"])}
    fp32 = torch.tensor(0.0).element_size()
    assert read == {"param", "grad", "exp_avg", "exp_avg_sq"} and len(read) * fp32 == 16
    assert written == {"param", "exp_avg", "exp_avg_sq"} and len(written) * fp32 == 12


def test_autocast_keeps_fp32_gradients_so_ddp_all_reduces_fp32() -> None:
    seen: list[torch.dtype] = []

    def record(_state, bucket):  # noqa: ANN001, ANN202 - DDP checks string annotations and rejects them
        seen.append(bucket.buffer().dtype)  # what the all-reduce would send
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)))
        model.register_comm_hook(None, record)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(4, 8))
        assert out.dtype == torch.bfloat16, "the forward computes in bf16"
        out.float().sum().backward()
    finally:
        dist.destroy_process_group()
    assert seen and set(seen) == {torch.float32}


def test_fp16_overflows_where_bf16_does_not() -> None:
    assert torch.finfo(torch.float16).max == 65504.0
    assert torch.finfo(torch.bfloat16).eps == 2.0**-7
    logits = torch.full((1024,), 100.0)  # one attention row's worth of large scores
    assert torch.isinf(logits.half().sum())  # 102,400 > 65,504
    assert torch.isfinite(logits.bfloat16().sum())
    assert torch.isinf(torch.tensor(12.0).half().exp())  # e^12 = 162,755 overflows fp16


def test_distributed_sampler_pads_the_index_list_to_a_multiple_of_the_world_size() -> None:
    dataset = list(range(10))
    shards = [list(DistributedSampler(dataset, num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3], "10 indices padded to 12: 3 per rank"
    everything = sorted(i for s in shards for i in s)
    assert everything == sorted([*range(10), 0, 1]), "the padding repeats the first indices"
    dropped = [list(DistributedSampler(dataset, num_replicas=4, rank=r, shuffle=False, drop_last=True))
               for r in range(4)]
    assert sorted(i for s in dropped for i in s) == list(range(8)), "drop_last cuts the list to 8"


# A fresh interpreter: forms a one-rank gloo group, then builds what the argument names,
# and prints whether torch._dynamo was imported before and after.
_DYNAMO_PROBE = """
import json, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = "torch._dynamo" in sys.modules
layer = torch.nn.Linear(4, 4)
if sys.argv[1] == "ddp":
    torch.nn.parallel.DistributedDataParallel(layer)
else:
    torch.optim.AdamW(layer.parameters())
print(json.dumps([before, "torch._dynamo" in sys.modules]))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("built", ["ddp", "optimizer"])
def test_building_ddp_or_a_torch_optimizer_imports_torch_dynamo(built: str) -> None:
    """Why a resumed DDP job cannot start as fast as `import torch` and a gloo group: DDP's
    constructor and the first torch optimizer each import torch._dynamo (about as long as
    `import torch` on a 2-core machine). The restart bench's second floor includes both."""
    run = subprocess.run([sys.executable, "-c", _DYNAMO_PROBE, built], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [False, True]
