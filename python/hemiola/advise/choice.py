"""From predictions (and short trials) to one configuration to use.

- **Trials.** Predictions err (their error, measured: docs/scale.md), so every
  configuration predicted within that error of the fastest is a candidate;
  the candidates are run for a few iterations each and the advice is the
  fastest *measured*, or, among those measured within NEAR of it, the least
  compressed and then the least approximate schedule (EXACTNESS: the exact
  ones first, ``sharded`` after ``wfbp`` and ``priority``, whose use is
  plainer: any optimizer, any device).
- **Streaming.** ``streaming`` is DiLoCo, not per-step SGD: its quality at
  equal tokens differs (on the byte-level LM after 300 steps its held-out
  loss was 8-14% above per-step training's: docs/streaming.md). So it is
  advised only where per-step training wastes most of the computation: when
  the best per-step configuration's compute utilisation (the bare step's
  time over the configuration's) is below STREAMING_BELOW, i.e. streaming
  would train at least twice the tokens per hour; then at the smallest H
  whose predicted utilisation reaches STREAMING_GOOD (smaller H stays
  closer to per-step training), else at the largest H.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hemiola.advise.model import CODINGS, Prediction

#: how far a prediction may be from its measurement: 67 of the 72 per-step
#: configurations of docs/benchmarks.md's 2-rank check (1 and 5 Gbit/s, three
#: models) were within 25%, 37 within 10% (on the H200, docs/scale.md, all
#: but priority's rows were within 25% too)
PREDICTION_ERROR = 0.25
#: measured times within this fraction of the fastest are a tie
NEAR = 0.03
#: at most this many configurations are tried (with 6, the fastest measured
#: was left out in one cell of that check: predicted 7th)
MAX_TRIALS = 8
#: without trials, predictions within this fraction of the fastest are a tie
PREDICTED_TIE = 0.05
#: streaming is advised when the best per-step utilisation is below this
STREAMING_BELOW = 0.5
#: and at the smallest H predicted to reach this utilisation
STREAMING_GOOD = 0.9

#: the per-step schedules, least approximate first: wfbp, priority and
#: sharded are the same synchronous SGD (sharded bitwise wfbp's), decoupled
#: steps on an approximation between exact corrections
EXACTNESS = ("wfbp", "priority", "sharded", "decoupled")

_CODING_ORDER = {name: k for k, name in enumerate(CODINGS)}
_SCHEDULE_ORDER = {name: k for k, name in enumerate(EXACTNESS)}

#: what each compression costs in accuracy, as measured (docs/benchmarks.md),
#: and what a schedule asks of the model where it asks more than wfbp
CAVEATS = {
    "fp16": "fp16: half precision on the wire, as DDP's fp16_compress_hook",
    "int8": "int8: one byte per element with error feedback; on the byte-level LM with "
            "AdamW +0.7% held-out loss against uncompressed (3 seeds)",
    "int4": "int4 (streaming's outer wire): four bits per element with error feedback; on "
            "the byte-level LM at H=20 the same held-out loss as int8 within the seeds' "
            "spread (3 seeds, docs/streaming.md)",
    "powersgd": "powersgd: rank-2 approximation with error feedback; on the byte-level LM "
                "with AdamW +15% held-out loss (torch DDP's PowerSGD hook alike): check "
                "your model's convergence before adopting it",
    "sharded": "sharded: wfbp's synchronous SGD (bitwise its result), each rank holding "
               "the gradients and optimizer state of 1/N of the parameters; it runs on CPU "
               "parameters, uncompressed, with an element-wise optimizer (SGD, Adam, AdamW, "
               "...), each parameter read in the same module every iteration",
    "streaming": "streaming is DiLoCo (H local steps, then an outer Nesterov step on the "
                 "averaged pseudo-gradient), not per-step SGD: on the byte-level LM after "
                 "300 steps its held-out loss was 8-14% above per-step training's "
                 "(docs/streaming.md); check your model's convergence",
}


#: bytes per parameter of the parameters, their gradients and AdamW's two
#: moments in float32 on each rank under DDP (and wfbp, priority, decoupled);
#: DDP's gradient buckets come on top
DDP_BYTES_PER_PARAM = 16


def sharded_bytes_per_param(world: int) -> float:
    """The same under ``sharded`` at `world` ranks: the parameters whole, the
    gradients and both moments of 1/N of them (ZeRO-2): 4 + 12/N; its at
    most ``buckets_in_flight`` bucket buffers of each kind come on top.
    Counted from the sizes, not measured."""
    if world < 1:
        raise ValueError(f"world must be at least 1, not {world}")
    return 4 + 12 / world


def within_error(predictions: Sequence[Prediction],
                 error: float = PREDICTION_ERROR) -> list[Prediction]:
    """The predictions that may, within `error`, be the fastest (fastest
    first, at most MAX_TRIALS)."""
    ordered = sorted(predictions, key=lambda p: p.seconds)
    best = ordered[0].seconds
    return [p for p in ordered if p.seconds * (1 - error) <= best * (1 + error)][:MAX_TRIALS]


def choose(measured: Mapping[str, float], predictions: Sequence[Prediction]) -> Prediction:
    """Among `predictions` measured (by name), the fastest, or within NEAR
    of it the least compressed, then the least approximate."""
    tried = [p for p in predictions if p.name in measured]
    if not tried:
        raise ValueError("no configuration was measured")
    fastest = min(measured[p.name] for p in tried)
    near = [p for p in tried if measured[p.name] <= fastest * (1 + NEAR)]
    return min(near, key=lambda p: (_CODING_ORDER[p.coding], _SCHEDULE_ORDER[p.schedule]))


def choose_predicted(predictions: Sequence[Prediction]) -> Prediction:
    """Without trials (a prediction for another cluster): the fastest
    predicted, or within PREDICTED_TIE of it the least compressed, then the
    least approximate."""
    fastest = min(p.seconds for p in predictions)
    near = [p for p in predictions if p.seconds <= fastest * (1 + PREDICTED_TIE)]
    return min(near, key=lambda p: (_CODING_ORDER[p.coding], _SCHEDULE_ORDER[p.schedule]))


def utilisation(compute: float, seconds: float) -> float:
    """The fraction of an iteration the computation alone would take."""
    return compute / seconds if seconds > 0 else 0.0


def streaming_advice(compute: float, per_step: float, streaming: Sequence[Prediction],
                     free_compute: float | None = None) -> Prediction | None:
    """The streaming configuration to advise instead of per-step training
    taking `per_step` seconds, or None (see the module's rule). `compute`:
    the bare step of a job whose ranks meet every step; `free_compute`:
    of ranks that meet every H steps, streaming's utilisation is of it
    (default: `compute`; ``Profile.free_compute``)."""
    if not streaming or utilisation(compute, per_step) >= STREAMING_BELOW:
        return None
    free = compute if free_compute is None else free_compute
    by_h = sorted(streaming, key=lambda p: p.options["sync_every"])
    for p in by_h:
        if utilisation(free, p.seconds) >= STREAMING_GOOD:
            return p
    return by_h[-1]
