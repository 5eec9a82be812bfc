"""``hemiola advise``: the command.

Where the job will run, as its ranks::

    torchrun --nproc-per-node 2 -m hemiola advise --model mypkg.models:make
    hemiola advise --local 2                 # two local ranks, the built-in MLP

measures a profile (:mod:`hemiola.advise.measure`), predicts every schedule x
compression and ``streaming`` (:mod:`hemiola.advise.model`), runs the
configurations predicted within their error of the fastest for a few
iterations, and advises the fastest measured (:mod:`hemiola.advise.choice`).

For a cluster not at hand::

    hemiola advise --model mypkg.models:make --save-profile p.json --world 64 --rate 25
    hemiola advise --profile p.json --world 256 --rate 100 --gpus-per-node 8

predicts each configuration at N ranks from the profile (measured here in one
process, or loaded) and a model of the collectives.

``--model MODULE:FACTORY`` names a function returning ``(model, loss_fn)`` or
``(model, loss_fn, make_optimizer)``: ``loss_fn(model)`` runs one training
batch's forward and returns the loss (each rank its own batch);
``make_optimizer(params)`` the optimizer (default SGD with momentum).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from hemiola.advise import choice, model
from hemiola.advise.collective import ALGORITHMS, Network
from hemiola.advise.model import local_network
from hemiola.advise.models import Factory, load_factory
from hemiola.advise.profile import MAX_WORLD, Profile, check_writable, number_text

GBIT = 1e9 / 8  # bytes per second


def advise_rank(rank: int, world: int, spec: str | None, repeats: int, iterations: int,
                profile_path: str | None = None, everything: bool = False,
                rescale: bool = False, timeline_dir: str | None = None,
                rounds: int = 1) -> dict[str, Any]:
    """One rank's part (also under torchrun: rank and world from its
    environment): measure (or load) the profile, predict at this job's
    world, try the candidates (`rounds` times each, see :func:`try_all`),
    choose. `rescale` (with a loaded profile): scale its CPU times by the
    bare step measured here over the profile's (more ranks than cores make
    every rank's CPU slower). `timeline_dir`: rank 0 writes there each
    configuration's predicted iterations and each tried one's measured
    timeline (Chrome trace JSON)."""
    import hemiola
    from hemiola.advise.agreement import job_pace
    from hemiola.advise.instruments import bare
    from hemiola.advise.measure import measure
    from hemiola.advise.models import make_workload
    from hemiola.distributed import new_engine

    hemiola.init()
    factory = load_factory(spec)
    engine, _ = new_engine(timeout_s=600.0)
    if profile_path is None:
        profile = measure(factory, repeats, engine)
    else:
        profile = Profile.load(Path(profile_path))
        if rescale:
            import torch

            from hemiola.advise.agreement import agree

            torch.set_num_threads(1)
            measured = bare(make_workload(factory), 3 * repeats,
                            lambda: engine.barrier().wait())
            here = agree(replace(profile, forward=measured.forward, backward=measured.backward,
                                 step=measured.step), engine, measured)
            factor = here.compute / profile.compute
            profile = replace(profile.scaled(factor), lockstep=here.lockstep)
            profile.meta = {**profile.meta, "rescaled": factor}
    net = local_network(profile, engine.world_size)
    predictions = model.predict(profile, net)
    streaming = model.predict_streaming(profile, net)
    # --all: every configuration, and streaming where a brief run sees syncs
    tried = (predictions + [s for s in streaming if s.options["sync_every"] <= 20]
             if everything else choice.within_error(predictions))
    folder = Path(timeline_dir) if timeline_dir is not None and rank == 0 else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        for p in predictions:
            (folder / f"predicted-{_file_name(p.name)}.json").write_text(
                model.predicted_timeline(profile, net, p.schedule, p.coding))
    rounds_ = try_all(factory, engine, tried, iterations, rounds, bare_around=everything,
                      folder=folder)
    measured = job_pace({name: statistics.median(times)
                         for name, times in rounds_["measured"].items()}, engine)
    bare_now = {name: statistics.median(times) for name, times in rounds_["bare"].items()}
    chosen = choice.choose(measured, predictions)
    return {"profile": profile.to_json(), "world": engine.world_size,
            "predictions": [vars(p) for p in predictions],
            "streaming": [vars(p) for p in streaming], "measured": measured,
            "rounds": rounds_, "bare_now": bare_now, "choice": vars(chosen),
            "run_seconds": measured[chosen.name]}


def try_all(factory: Factory, engine: Any, tried: list[model.Prediction], iterations: int,
            rounds: int, bare_around: bool = False,
            folder: Path | None = None) -> dict[str, dict[str, list[float]]]:
    """Runs every configuration in `tried` for `iterations`, `rounds` times,
    the order reversed every other round (A B C, C B A, ...), so that a
    machine whose speed drifts (other work, a shared host) slows each
    configuration alike instead of whichever ran last; a configuration's time
    is then the median of its rounds. Returns each configuration's seconds per
    iteration per round (``"measured"``) and, with `bare_around` (validation),
    the bare step measured around each trial, the mean of the one before and
    the one after (``"bare"``: what the computation cost meanwhile). `folder`:
    the first round's engine timelines go there."""
    from hemiola.advise.measure import Progress
    from hemiola.advise.trials import bare_step, trial

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    times: dict[str, list[float]] = {p.name: [] for p in tried}
    bare_times: dict[str, list[float]] = {p.name: [] for p in tried} if bare_around else {}
    progress = Progress(rounds * len(tried), engine.rank, verb="trying")
    for round_ in range(rounds):
        for p in (tried if round_ % 2 == 0 else tried[::-1]):
            progress.step(f"{p.name} for {iterations} iterations (round {round_ + 1})")
            engine.barrier().wait()
            before = bare_step(factory, iterations // 2 + 1, engine) if bare_around else 0.0
            engine.barrier().wait()
            timeline = (folder / f"measured-{_file_name(p.name)}.json"
                        if folder is not None and round_ == 0 else None)
            times[p.name].append(trial(factory, p, iterations, timeline=timeline))
            if bare_around:
                after = bare_step(factory, iterations // 2 + 1, engine)
                bare_times[p.name].append((before + after) / 2)
    return {"measured": times, "bare": bare_times}


def _file_name(name: str) -> str:
    """A configuration's name as a file name ('streaming+int8/sync_every=20,...')."""
    return name.replace("/", "_").replace(",", "_").replace("=", "")


def _label(p: dict[str, Any]) -> str:
    text = f"schedule={p['schedule']!r}"
    if p["coding"] != "none":
        text += f", compression={p['coding']!r}"
    for k, v in p.get("options", {}).items():
        text += f", {k}={v}"
    return text


def _name(p: dict[str, Any]) -> str:
    return model.Prediction(p["schedule"], p["coding"], p["seconds"], p.get("options", {})).name


def _streaming_lines(profile: Profile, best: float, streaming: list[dict[str, Any]],
                     measured: dict[str, float]) -> list[str]:
    # streaming's ranks meet every H steps: its utilisation is of their pace
    lines = ["streaming (DiLoCo; the coding on the wire as named), predicted per inner step:"]
    for s in streaming:
        seen = measured.get(_name(s))
        check = f"  measured {1e3 * seen:8.1f} ms" if seen is not None else ""
        lines.append(f"  {1e3 * s['seconds']:8.1f} ms  utilisation "
                     f"{choice.utilisation(profile.free_compute, s['seconds']):4.2f}  "
                     f"{_label(s)}{check}")
    advice = choice.streaming_advice(profile.compute, best,
                                     [model.Prediction(**s) for s in streaming],
                                     profile.free_compute)
    u = choice.utilisation(profile.compute, best)
    if advice is None:
        lines.append(f"Streaming: not advised: the best per-step configuration keeps the "
                     f"computation busy {100 * u:.0f}% of the time (streaming is advised below "
                     f"{100 * choice.STREAMING_BELOW:.0f}%).")
    else:
        lines.append(f"Streaming: advised instead (per-step keeps the computation busy only "
                     f"{100 * u:.0f}%): hemiola.wrap(model, optimizer, {_label(vars(advice))})")
        lines.append(f"  ({choice.CAVEATS['streaming']})")
        if advice.coding in choice.CAVEATS:
            lines.append(f"  ({choice.CAVEATS[advice.coding]})")
    return lines


def _caveats(best: dict[str, Any]) -> list[str]:
    """What the advised configuration's compression and schedule ask."""
    return [f"  ({choice.CAVEATS[key]})" for key in (best["coding"], best["schedule"])
            if key in choice.CAVEATS]


def _sharded_lines(profile: Profile, world: int, predicted: bool) -> list[str]:
    """What ``sharded`` is for (its memory, counted from the sizes), or why
    it is not predicted."""
    refused = profile.meta.get("refused", {}).get("sharded")
    if refused is not None:
        return [f"sharded: not predicted: it refused this model when measured ({refused})"]
    if not predicted:
        return ["sharded: not predicted: it runs on CPU parameters (the Gloo wire), "
                "uncompressed, in this build"]
    params = sum(p.numel for p in profile.params)
    mine = choice.sharded_bytes_per_param(world)
    ddp = choice.DDP_BYTES_PER_PARAM
    return [f"sharded is for memory: each rank keeps the gradients and optimizer state of "
            f"1/{world} of the parameters; with AdamW in float32 that is 4 + 12/N = "
            f"{mine:.1f} bytes per parameter ({_mib(mine * params)} for these "
            f"{params / 1e6:.2f}M parameters) against DDP's {ddp} and more "
            f"({_mib(ddp * params)} and its gradient buckets), plus at most "
            f"{model.BUCKETS_IN_FLIGHT} bucket buffers of each kind (counted from the sizes, "
            "not measured)"]


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def report(result: dict[str, Any]) -> str:
    """What rank 0 prints."""
    profile = Profile.from_json(result["profile"])
    world = result["world"]
    link = profile.link
    lines = [f"{world} ranks. Measured here (medians): computation {1e3 * profile.compute:.1f} "
             f"ms (forward {1e3 * profile.forward:.1f}, backward {1e3 * profile.backward:.1f}, "
             f"step {1e3 * profile.step:.1f}); contention {profile.contention:.2f}"]
    if "slowest_rank" in profile.meta:
        lines.append(f"  (the slowest rank's: {profile.meta['slowest_rank']:.2f}x rank 0's "
                     "computation; a job goes at its slowest rank's pace)")
    if link is not None:
        lines.append(f"link: {8 * link.bandwidth / 1e9:.3f} Gbit/s, latency "
                     f"{1e6 * link.latency:.0f} us (at {link.world} ranks)")
        if profile.wire_rate_beside > 0:
            rate = 8 * profile.wire_rate_beside / 1e9
            lines.append(f"  beside the computation it sends {rate:.3f} Gbit/s at most (the "
                         "CPU it shares with the computation)")
        net = local_network(profile, world)
        lines.append("all-reduce of all gradients: measured / modelled (coding CPU; the "
                     "ranks' wait for each other, added):")
        for coding in model.CODINGS:
            if coding not in profile.reduce:
                continue
            modelled = model.reduction_alone(profile, net, coding)
            lines.append(f"  {coding:9s} {1e3 * profile.reduce[coding]:8.1f} / "
                         f"{1e3 * modelled:8.1f} ms  ({1e3 * profile.coding_cpu[coding]:.1f}; "
                         f"{1e3 * profile.peer_wait.get(coding, 0.0):.1f})")
    measured = result.get("measured", {})
    lines.append("Predicted time per iteration (measured where tried):")
    for p in result["predictions"]:
        seen = measured.get(_name(p))
        check = "" if seen is None else (f"  measured {1e3 * seen:8.1f} ms "
                                         f"({100 * (p['seconds'] / seen - 1):+.0f}%)")
        lines.append(f"  {1e3 * p['seconds']:8.1f} ms  {_label(p)}{check}")
    lines += _sharded_lines(profile, world, any(p["schedule"] == "sharded"
                                                for p in result["predictions"]))
    best = result["choice"]
    lines.append(f"Use: hemiola.wrap(model, optimizer, {_label(best)})")
    lines += _caveats(best)
    seconds = result["run_seconds"]
    lines.append(f"Checked: {1e3 * seconds:.1f} ms per iteration measured against "
                 f"{1e3 * best['seconds']:.1f} ms predicted "
                 f"({100 * (seconds / best['seconds'] - 1):+.0f}%).")
    if seconds < 0.9 * profile.compute:
        lines.append(f"Warning: the configuration ran faster than the bare computation "
                     f"measured before it ({1e3 * profile.compute:.1f} ms): other work on this "
                     "machine changed its speed meanwhile, so the predictions are off; "
                     "measure again when it is quiet (the choice above was measured).")
    lines += _streaming_lines(profile, seconds, result["streaming"], measured)
    return "\n".join(lines)


def network_of(args: argparse.Namespace, profile: Profile) -> Network:
    """The cluster the options describe (the profile's own link when no --rate)."""
    if args.rate is None:
        base = local_network(profile, args.world)
        bandwidth, latency = base.bandwidth, base.latency
    else:
        bandwidth = args.rate * GBIT
        latency = args.latency_us * 1e-6
    return Network(world=args.world, bandwidth=bandwidth, latency=latency,
                   gpus_per_node=args.gpus_per_node, intra_bandwidth=args.intra_rate * GBIT,
                   algorithm=args.algorithm, sharing=args.sharing)


def scale_report(profile: Profile, net: Network) -> str:
    """Every configuration at `net`'s world size, fastest first."""
    predictions = model.predict(profile, net)
    streaming = model.predict_streaming(profile, net)
    compute = profile.compute
    nodes = f", {net.gpus_per_node} per node" if net.gpus_per_node > 1 else ""
    lines = [f"Predicted at {net.world} ranks{nodes}, {8 * net.bandwidth / 1e9:g} Gbit/s, "
             f"latency {1e6 * net.latency:g} us, {net.algorithm} all-reduce (computation "
             f"{1e3 * compute:.1f} ms per iteration, from the profile):"]
    for p in predictions:
        lines.append(f"  {1e3 * p.seconds:9.1f} ms  utilisation "
                     f"{choice.utilisation(compute, p.seconds):4.2f}  {_label(vars(p))}")
    lines += _sharded_lines(profile, net.world, any(p.schedule == "sharded"
                                                    for p in predictions))
    best = choice.choose_predicted(predictions)
    lines.append(f"Use: hemiola.wrap(model, optimizer, {_label(vars(best))})  (predicted; "
                 f"predictions err by up to {100 * choice.PREDICTION_ERROR:.0f}%: docs/scale.md)")
    lines += _caveats(vars(best))
    if model.replica_networks(net)[0] is not None:
        lines.append(f"streaming: a replica is a node's {net.gpus_per_node} ranks (their inner "
                     f"steps wfbp over the node's link; the outer sync between the {net.nodes} "
                     "nodes, one fragment per node's link)")
    lines += _streaming_lines(profile, best.seconds, [vars(s) for s in streaming], {})
    return "\n".join(lines)


def _predict_elsewhere(args: argparse.Namespace) -> int:
    if args.profile is not None:
        profile = Profile.load(Path(args.profile))
    else:
        from hemiola.advise.measure import measure

        profile = measure(load_factory(args.model), args.repeats, None)
    if args.save_profile:
        profile.save(Path(args.save_profile))
        print(f"profile written to {args.save_profile}")
    print(scale_report(profile, network_of(args, profile)))
    return 0


def _finish(args: argparse.Namespace, result: dict[str, Any]) -> None:
    print(report(result))
    if args.save_profile:
        Profile.from_json(result["profile"]).save(Path(args.save_profile))
        print(f"profile written to {args.save_profile}")
    if args.json:
        Path(args.json).write_text(json.dumps(result) + "\n")
    if args.world is not None:
        profile = Profile.from_json(result["profile"])
        print(scale_report(profile, network_of(args, profile)))


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except ValueError as e:
        raise SystemExit(f"hemiola advise: {e}") from e
    except ArithmeticError as e:  # an overflow the checks let through: one line still
        raise SystemExit(f"hemiola advise: the prediction failed ({type(e).__name__}: {e}): "
                         "check the profile's and the options' numbers") from e


def _main(args: argparse.Namespace) -> int:
    from hemiola.launch import run_local

    job = "WORLD_SIZE" in os.environ
    if args.world is not None and args.world < 1:
        raise SystemExit("--world must be at least 1")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if getattr(args, "save_profile", None):  # refused now, not after measuring for minutes
        check_writable(Path(args.save_profile), "the profile")
    if not job and not args.local:
        if args.world is None:
            raise SystemExit("hemiola advise measures on the job's ranks: run it under torchrun "
                             "or with --local N; or give --world N (and --rate GBIT or "
                             "--profile FILE) to predict a cluster")
        return _predict_elsewhere(args)
    call = (args.model, args.repeats, args.iterations, args.profile, args.all,
            args.rescale_compute, args.timeline, args.rounds)
    if args.local:
        result = run_local(advise_rank, args.local, *call, timeout_s=3600)[0]
        _finish(args, result)
        return 0
    rank = int(os.environ.get("RANK", "0"))
    result = advise_rank(rank, int(os.environ["WORLD_SIZE"]), *call)
    if rank == 0:
        _finish(args, result)
    return 0


def bounded(kind: type, low: float, high: float, unit: str) -> Any:
    """An argparse type: a `kind` (int or float) from `low` to `high`, finite;
    else argparse's one-line error naming the option and the value."""
    def parse(text: str) -> int | float:
        what = "an integer" if kind is int else "a finite number"
        must = f"must be {what} from {number_text(low)} to {number_text(high)} {unit}".rstrip()
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: it {must}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: it {must}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value" otherwise
    return parse


def register(commands: Any) -> None:
    """Adds ``hemiola advise`` to the CLI."""
    p = commands.add_parser("advise", help="measure this model on this network and say which "
                                           "schedule and compression to use, here or at N ranks",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="MODULE:FUNCTION",
                   help="a function returning (model, loss_fn[, make_optimizer]); default: a "
                        "9.4M-parameter MLP")
    p.add_argument("--local", type=int, metavar="N",
                   help="spawn N local ranks instead of running as one rank of torchrun")
    p.add_argument("--repeats", type=bounded(int, 1, 10_000, ""), default=5,
                   help="repetitions per measurement")
    p.add_argument("--iterations", type=bounded(int, 1, 1_000_000, ""), default=10,
                   help="iterations of each configuration tried")
    p.add_argument("--rounds", type=bounded(int, 1, 1000, ""), default=1,
                   help="try each configuration this many times, in alternating order, and "
                        "take the median (on a machine whose speed drifts: a shared host)")
    p.add_argument("--all", action="store_true",
                   help="try every configuration (and streaming), not only the candidates")
    p.add_argument("--save-profile", metavar="FILE", help="write the measured profile here")
    p.add_argument("--profile", metavar="FILE",
                   help="predict from this profile instead of measuring one (on the job's "
                        "ranks: then try the configurations here)")
    p.add_argument("--json", metavar="FILE", help="write rank 0's whole result here")
    p.add_argument("--timeline", metavar="DIR",
                   help="write here each configuration's predicted iterations and each tried "
                        "one's measured timeline (Chrome trace JSON: chrome://tracing or "
                        "ui.perfetto.dev), to see where a prediction and a run part")
    p.add_argument("--rescale-compute", action="store_true",
                   help="with --profile on the job's ranks: scale the profile's CPU times by "
                        "the bare step measured here (validation with more ranks than cores)")
    scale = p.add_argument_group("prediction for a cluster not at hand")
    scale.add_argument("--world", type=bounded(int, 1, MAX_WORLD, "ranks"), metavar="N",
                       help="ranks to predict")
    scale.add_argument("--rate", type=bounded(float, 1e-6, 1e6, "Gbit/s"), metavar="GBIT",
                       help="what an all-reduce gets of each rank's (node's) link, Gbit/s "
                            "(default: the profile's measured link)")
    scale.add_argument("--latency-us", type=bounded(float, 0, 1e6, "microseconds"), default=25.0,
                       help="per message between nodes (default 25: TCP over Ethernet)")
    scale.add_argument("--gpus-per-node", type=bounded(int, 1, 1024, ""), default=1)
    scale.add_argument("--intra-rate", type=bounded(float, 1e-6, 1e6, "Gbit/s"), default=1200.0,
                       metavar="GBIT",
                       help="inside a node (default 1200: NVLink-class)")
    scale.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    scale.add_argument("--sharing", type=bounded(int, 1, 10_000, ""), default=1, metavar="K",
                       help="jobs whose transfers share each node's link (the cluster "
                            "simulator's contention law)")
    p.set_defaults(run=main)
