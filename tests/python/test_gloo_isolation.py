"""libtorch exports its own Gloo. Our extension's Gloo must never bind to it,
whatever the import order and even with TORCH_USE_RTLD_GLOBAL=1; and torch's
own Gloo process group must keep working beside ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from hemiola.launch import free_port

# Runs in a fresh interpreter, so the import order below is the real one.
SCRIPT = """
import json, sys
if sys.argv[1] == "hemiola_first":
    import hemiola
    import torch
else:
    import torch
    import hemiola
import torch.distributed as dist

hemiola.init()
rank = dist.get_rank()
model, _ = hemiola.wrap(torch.nn.Linear(1000, 1000), None, timeout_s=30)
model(torch.full((4, 1000), float(rank + 1))).sum().backward()
theirs = torch.full((1000,), float(rank + 1))
dist.all_reduce(theirs)  # torch's own Gloo
print(json.dumps([model.module.weight.grad[0, 0].item(), theirs[0].item()]))
dist.destroy_process_group()  # torch's Gloo thread must not outlive the interpreter
"""


@pytest.mark.parametrize("order", ["torch_first", "hemiola_first"])
@pytest.mark.parametrize("rtld_global", ["0", "1"])
def test_our_gloo_and_torchs_coexist(order: str, rtld_global: str) -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCH_USE_RTLD_GLOBAL=rtld_global, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, order], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
        ours, theirs = json.loads(out.strip().splitlines()[-1])
        assert ours == pytest.approx(4 * 1.5)  # batch 4, inputs 1 and 2 averaged
        assert theirs == 3.0
    del store
