"""``hemiola advise`` against measurement on a real rate-limited network:
every configuration's predicted time beside its measured time, and the
advice beside the fastest measured.

    hemiola bench advise --models mlp,lm,cnn --rates 1gbit,5gbit      # as root
    hemiola bench advise --models mlp-small --rates 150mbit --worlds 2,3,4
    hemiola bench advise --scale      # docs/scale.md's predictions at 8-1024 GPUs
    hemiola bench advise --published  # docs/scale.md's check against published results
    hemiola bench advise --gpu-rows   # docs/scale.md's check against the H200 rows

For each model and rate, N network namespaces joined by ``tc tbf`` links
(:mod:`hemiola.bench.netlab`) run ``python -m hemiola advise --all`` as the
ranks of one job (one thread per rank): it measures its profile, predicts,
and then runs every configuration (streaming at H = 10 and 20) for
--iterations each. At the first world size the profile is measured and
saved; at the others (``--worlds 2,3,4``) it is *not* measured again: the
ranks predict from the first one's profile (its link's latency and
bandwidth, scaled by the collective model) and measure, which checks the
prediction of a cluster from a profile. More ranks than cores make every
rank's computation slower, which no cluster of one device per rank does:
there the profile's CPU times are scaled by the bare step measured at that
world size (``--rescale-compute``; the factor is in the rows), so what is
checked is the collectives' model at N ranks. One row per configuration goes to
OUT/NAME.jsonl, with the load average before and after each job (timing on
a loaded machine is not a validation: read that column); each profile to
OUT/NAME-MODEL-RATE.profile.json.

This machine's speed drifts: the same configuration, measured in four grids
of the same command, took times whose range was 23% of their median (the
median configuration's), and one CPU process's bare step varies by -9% to
+15% (p10-p90) from one step to the next. ``--rounds R`` runs every configuration R
times in alternating order (A B C, C B A, ...) and keeps the median (each
round's time is in ``measured_rounds_ms``). Each trial is bracketed by bare
steps, and the rows also give the prediction from the profile with its CPU
times scaled to the bare step measured around that configuration's trials
(``predicted_now_ms``, ``error_now``) and to the median of all of them
(``predicted_trials_ms``, ``error_trials``): the model's error when its one
input that drifts, the computation's speed, is measured when the
configurations ran rather than minutes before.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from hemiola.bench.advise_models import MODELS
from hemiola.bench.netlab import Network
from hemiola.bench.record import DEFAULT_OUT, write_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="mlp",
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--rates", default="1gbit,5gbit", help="tc rates, comma-separated")
    parser.add_argument("--worlds", default="2",
                        help="world sizes, comma-separated; the first measures the profile")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="trials of each configuration, in alternating order (the row "
                             "gives their median and each)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="advise", help="results go to OUT/NAME.jsonl")
    parser.add_argument("--scale", action="store_true",
                        help="measure nothing: print docs/scale.md's predictions for ResNet-50 "
                             "and GPT-2-124M at 8-1024 GPUs (hemiola.bench.advise_scale)")
    parser.add_argument("--error", type=float, default=0.15,
                        help="--scale: the predictions' relative error, as validated")
    parser.add_argument("--gpu-rows", nargs="?", const=True, type=Path,
                        metavar="DIR",
                        help="measure nothing: print docs/scale.md's predictions of the H200 "
                             "rows in DIR (default docs/results/gpu, from the checkout's root) "
                             "against them (hemiola.bench.advise_gpu)")
    parser.add_argument("--published", action="store_true",
                        help="measure nothing: print docs/scale.md's predictions of published "
                             "scaling results against them (hemiola.bench.published)")


def predicted_at(result: dict[str, Any], p: dict[str, Any], compute: float) -> float:
    """The prediction of `p` from the profile with its CPU times scaled so
    that the bare step takes `compute` seconds (what it took when the
    configurations ran, on a machine whose speed drifts)."""
    from hemiola.advise import model
    from hemiola.advise.model import local_network
    from hemiola.advise.profile import Profile

    prediction = model.Prediction(**p)
    profile = Profile.from_json(result["profile"])
    profile = profile.scaled(compute / profile.compute)
    net = local_network(profile, result["world"])
    if prediction.schedule == "streaming":
        o = prediction.options
        return model.streaming_step(profile, net, o["sync_every"], o["fragments"], o["overlap"],
                                    prediction.coding)
    return model.predict_one(profile, net, prediction.schedule, prediction.coding)


def bare_during_trials(result: dict[str, Any]) -> float:
    """The median of every bare step measured around the trials: the
    computation's cost while the configurations ran, from many more steps
    than any one trial's brackets."""
    return statistics.median(t for times in result["rounds"]["bare"].values() for t in times)


def advice_without_all(predictions: list[dict[str, Any]], measured: dict[str, float]) -> str:
    """What ``hemiola advise`` without ``--all`` would advise: the trials
    run only the per-step configurations predicted within the predictions'
    error of the fastest, and the choice is made among those. (``--all``
    runs every configuration for the check, and its own choice among all of
    them would be the fastest measured by construction.)"""
    from hemiola.advise.choice import choose, within_error
    from hemiola.advise.model import Prediction

    candidates = within_error([Prediction(**p) for p in predictions])
    return choose(measured, candidates).name


def rows_of(result: dict[str, Any], model: str, rate: str, profile_world: int,
            load: tuple[float, float]) -> list[dict[str, Any]]:
    """One row per configuration measured: predicted against measured (and
    the prediction at the load measured around its trial)."""
    from hemiola.advise.model import Prediction

    measured = result["measured"]
    fastest = min(measured.values())
    chosen = advice_without_all(result["predictions"], measured)
    during = bare_during_trials(result)
    rows = []
    for p in result["predictions"] + result["streaming"]:
        name = Prediction(**p).name
        if name not in measured:
            continue
        now = predicted_at(result, p, result["bare_now"][name])
        trials = predicted_at(result, p, during)
        rows.append({"suite": "advise", "model": model, "rate": rate, "world": result["world"],
                     "profile_world": profile_world, "config": name,
                     "predicted_ms": 1e3 * p["seconds"], "measured_ms": 1e3 * measured[name],
                     "error": p["seconds"] / measured[name] - 1,
                     "measured_rounds_ms": [1e3 * t for t in result["rounds"]["measured"][name]],
                     "bare_now_ms": 1e3 * result["bare_now"][name],
                     "predicted_now_ms": 1e3 * now, "error_now": now / measured[name] - 1,
                     "bare_trials_ms": 1e3 * during, "predicted_trials_ms": 1e3 * trials,
                     "error_trials": trials / measured[name] - 1,
                     "advised": name == chosen,
                     "fastest": measured[name] == fastest,
                     "compute_ms": 1e3 * (result["profile"]["forward"]
                                          + result["profile"]["backward"]
                                          + result["profile"]["step"]),
                     "rescaled": result["profile"]["meta"].get("rescaled", 1.0),
                     "load_before": load[0], "load_after": load[1]})
    return rows


def run(args: argparse.Namespace) -> int:
    if args.published:
        from hemiola.bench import published

        print(published.table())
        return 0
    if args.gpu_rows is not None:
        from hemiola.bench import advise_gpu

        # Without DIR: const (True; argparse would convert a string const).
        rows = advise_gpu.RESULTS if args.gpu_rows is True else args.gpu_rows
        if not rows.is_dir():
            raise SystemExit(f"--gpu-rows: {rows} is not a directory (run from the "
                             "checkout's root, or name the directory of the H200 rows)")
        print(advise_gpu.table(rows))
        return 0
    if args.scale:
        from hemiola.bench import advise_scale

        for profile in (advise_scale.resnet50_profile(), advise_scale.gpt2_profile()):
            print(f"**{profile.meta['model']}** (computation {1e3 * profile.compute:.1f} ms "
                  f"per iteration):\n\n{advise_scale.table(profile, args.error)}\n")
        return 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    worlds = [int(w) for w in args.worlds.split(",")]
    rows: list[dict[str, Any]] = []
    port = 29600
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            if model not in MODELS:
                raise SystemExit(f"unknown model {model!r}; known: {', '.join(MODELS)}")
            for rate in args.rates.split(","):
                profile = args.out / f"{args.name}-{model}-{rate}.profile.json"
                for world in worlds:
                    out = Path(tmp) / f"{model}-{rate}-{world}.json"
                    command = [sys.executable, "-m", "hemiola", "advise", "--all",
                               "--iterations", str(args.iterations), "--repeats",
                               str(args.repeats), "--rounds", str(args.rounds),
                               "--json", str(out)]
                    if MODELS[model]:
                        command += ["--model", str(MODELS[model])]
                    command += (["--save-profile", str(profile)] if world == worlds[0]
                                else ["--profile", str(profile), "--rescale-compute"])
                    before = os.getloadavg()[0]
                    with Network(world, rate) as net:
                        text = net.run_ranks(command, port, args.timeout_s)[0]
                    port += 1
                    print(f"--- {model}, {rate}, {world} ranks (load {before:.1f}) ---\n"
                          f"{text[text.find(f'{world} ranks.'):]}", flush=True)
                    result = json.loads(out.read_text())
                    rows += rows_of(result, model, rate, worlds[0],
                                    (before, os.getloadavg()[0]))
    path = write_lines(args.out / f"{args.name}.jsonl", rows)
    for r in rows:
        mark = " (advised)" if r["advised"] else ""
        mark += " (fastest)" if r["fastest"] else ""
        print(f"{r['model']:>9s} {r['rate']:>7s} {r['world']}: {r['config']:45s} predicted "
              f"{r['predicted_ms']:8.1f} ms, measured {r['measured_ms']:8.1f} ms "
              f"({100 * r['error']:+.1f}%; at the trials' computation: "
              f"{r['predicted_trials_ms']:8.1f} ms, {100 * r['error_trials']:+.1f}%){mark}")
    print(f"wrote {path}")
    return 0
