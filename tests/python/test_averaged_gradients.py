"""``model.averaged_gradients()`` and ``model.grad_norm()``: the gradient the
optimizer applies, under every schedule, where ``.grad`` keeps this rank's
own under ``priority`` and ``decoupled`` (issue 57, item 10)."""

from __future__ import annotations

import torch

from hemiola.launch import run_local

import workers


def test_every_schedule_offers_the_averaged_gradient_ddp_keeps_in_grad():
    results = run_local(workers.averaged_gradients_per_schedule, 2)
    for schedule in ("wfbp", "priority", "decoupled"):
        ranks = [results[r][schedule] for r in (0, 1)]
        for step in range(4):
            for name, g in ranks[0]["grads"][step].items():
                # the mean of the two ranks' own gradients, bitwise (two
                # values: their sum and the halving are rounded once each)
                if schedule == "wfbp":  # .grad is already the average there
                    mean = ranks[0]["local"][step][name]
                else:
                    mean = (ranks[0]["local"][step][name] + ranks[1]["local"][step][name]) / 2
                    assert not torch.equal(ranks[0]["local"][step][name], mean)
                torch.testing.assert_close(g, mean, rtol=0, atol=0,
                                           msg=f"{schedule} step {step} {name}")
                assert torch.equal(g, ranks[1]["grads"][step][name])
            norm = torch.nn.utils.get_total_norm(list(ranks[0]["grads"][step].values()))
            assert ranks[0]["norms"][step] == ranks[1]["norms"][step] == float(norm)
    # priority is exact: the same gradients as wfbp (DDP) at every step
    for step in range(4):
        for name, g in results[0]["priority"]["grads"][step].items():
            assert torch.equal(g, results[0]["wfbp"]["grads"][step][name])
