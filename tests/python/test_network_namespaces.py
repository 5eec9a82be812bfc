"""Ranks in different network namespaces (separate network stacks, as on
separate hosts) connect: the engine binds the address that routes to
MASTER_ADDR, or the interface named by GLOO_SOCKET_IFNAME.

Rank 0 runs in this (root) namespace, rank 1 in a namespace this test creates,
joined by a veth pair; both are removed afterwards. Traffic only ever goes to
the two addresses of that pair."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from hemiola.launch import free_port

ROOT_ADDR, PEER_ADDR = "10.231.7.1", "10.231.7.2"

SCRIPT = """
import json, torch, hemiola
hemiola.init()
rank = torch.distributed.get_rank()
model, _ = hemiola.wrap(torch.nn.Linear(100, 100), None, timeout_s=30)
model(torch.full((2, 100), float(rank + 1))).sum().backward()
print(json.dumps(model.module.weight.grad[0, 0].item()))
torch.distributed.destroy_process_group()
"""


def _can_use_netns() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"hemiola-probe-{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def peer_namespace() -> Iterator[tuple[str, str, str]]:
    if not _can_use_netns():
        pytest.skip("needs root and `ip netns`")
    tag = uuid.uuid4().hex[:6]
    ns, host_end, peer_end = f"hemiola-{tag}", f"hmh{tag}", f"hmp{tag}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", peer_end)
        _ip("link", "set", peer_end, "netns", ns)
        _ip("addr", "add", f"{ROOT_ADDR}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "addr", "add", f"{PEER_ADDR}/30", "dev", peer_end)
        _ip("-n", ns, "link", "set", peer_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, host_end, peer_end
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("selection", ["master_addr_route", "gloo_socket_ifname"])
def test_ranks_in_separate_namespaces_connect(peer_namespace: tuple[str, str, str],
                                              selection: str) -> None:
    ns, host_end, peer_end = peer_namespace
    port = free_port()
    store = dist.TCPStore("0.0.0.0", port, 2, is_master=True, wait_for_workers=False)
    procs = []
    for rank, (prefix, iface) in enumerate([([], host_end), (["ip", "netns", "exec", ns],
                                                              peer_end)]):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=ROOT_ADDR,
                   MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                   OMP_NUM_THREADS="1")
        env.pop("GLOO_SOCKET_IFNAME", None)
        if selection == "gloo_socket_ifname":
            env["GLOO_SOCKET_IFNAME"] = iface
        procs.append(subprocess.Popen([*prefix, sys.executable, "-c", SCRIPT], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {rank}:\n{err[-3000:]}"
        assert json.loads(out.strip().splitlines()[-1]) == pytest.approx(2 * 1.5)
    del store
