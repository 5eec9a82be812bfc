"""hemiola.bench.netlab: two ranks in rate-limited network namespaces train a step
with hemiola, and every namespace and interface is gone afterwards (also when
the block raises). Skipped without root or `ip netns`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hemiola.bench import netlab

REASON = netlab.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"netlab unavailable: {REASON}")

SCRIPT = """
import json, torch, hemiola
torch.set_num_threads(1)
hemiola.init()
rank = torch.distributed.get_rank()
model, _ = hemiola.wrap(torch.nn.Linear(100, 100), None, timeout_s=30)
model(torch.full((2, 100), float(rank + 1))).sum().backward()
print(json.dumps(model.module.weight.grad[0, 0].item()))
torch.distributed.destroy_process_group()
"""


def _assert_gone(tag: str) -> None:
    assert not [ns for ns in netlab.leftovers() if tag in ns]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tag not in links


def test_two_ranks_reduce_over_rate_limited_namespaces() -> None:
    with netlab.Network(2, rate="100mbit") as net:
        tag = net.tag
        assert set(net.namespaces) <= set(netlab.leftovers())
        qdisc = net.run(1, ["tc", "qdisc", "show", "dev", net.ifaces[1]]).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        procs = [
            net.popen(rank, [sys.executable, "-c", SCRIPT],
                      env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": net.addrs[0],
                           "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": net.ifaces[rank],
                           # rank 0 hosts the store (not an agent: unset)
                           "OMP_NUM_THREADS": "1", "TORCHELASTIC_USE_AGENT_STORE": ""},
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for rank in range(2)
        ]
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"rank {rank}:\n{err[-3000:]}"
            # Inputs are all 1 on rank 0 and all 2 on rank 1: the average is 2 * 1.5.
            assert json.loads(out.strip().splitlines()[-1]) == pytest.approx(2 * 1.5)
    _assert_gone(tag)


def test_cleanup_when_the_block_raises() -> None:
    with pytest.raises(KeyboardInterrupt):
        with netlab.Network(2, rate="100mbit") as net:
            tag = net.tag
            sleeper = net.popen(0, ["sleep", "60"])
            raise KeyboardInterrupt
    assert sleeper.returncode is not None
    _assert_gone(tag)


def test_bench_ps_runs_every_rank_behind_the_rate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`hemiola bench ps --rate`: the parameter server's ranks and the all-reduce
    ones train in namespaces behind the limit, which sets their pace, and leave
    none behind."""
    before = set(netlab.leftovers())
    bench = subprocess.Popen(
        [sys.executable, "-m", "hemiola", "bench", "ps", "--rate", "100mbit", "--model",
         "wide-mlp", "--workers", "2", "--schemes", "bsp", "eager", "wfbp", "--slowdowns", "3",
         "--iterations", "10", "--out", str(tmp_path), "--name", "ps"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = bench.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        bench.terminate()  # SIGTERM: the bench deletes its namespaces on the way out
        _, err = bench.communicate(timeout=60)
        pytest.fail(f"hemiola bench ps --rate still ran after 600 s:\n{err[-3000:]}")
    assert bench.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "ps.jsonl").read_text().splitlines()]
    runs = {r["scheme"]: r for r in rows if r["row"] == "run"}
    assert set(runs) == {"bsp", "eager", "wfbp"}
    # 300k float32 parameters: each bsp round moves 2 x 1.2 MB through the
    # server's 100 Mbit/s link each way, at least 0.19 s; on loopback it takes ~10 ms.
    params = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    link_s = 2 * 4 * params * 8 / 100e6
    for scheme, run in runs.items():
        assert run["rate"] == "100mbit" and run["model"] == "wide-mlp"
        assert run["t_ref_ms"] >= 1000 * link_s  # bsp without the straggler: the link alone
        assert run["iterations"] >= 5 and 0 <= run["final_accuracy"] <= 1
        if scheme == "bsp":
            assert run["ms_per_iteration"] >= 1000 * link_s
    # eager's fast worker does not wait for the straggler: it makes more iterations.
    fast, straggler = runs["eager"]["own_iterations"]
    assert fast > straggler
    assert not [ns for ns in netlab.leftovers() if ns not in before]
