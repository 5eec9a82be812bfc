"""How long a bucket takes on the wire at N ranks: alpha-beta models of the
collectives each coding makes.

A message costs ``latency`` (alpha) and each byte ``1 / bandwidth`` (beta),
where ``bandwidth`` is what one rank (or, with several GPUs per node, one
node's network interface) sends and receives per second at the same time:

- ring all-reduce of m bytes over n ranks: ``2 (n-1) alpha + 2 (n-1)/n m / bw``
  (reduce-scatter then all-gather: Gloo's algorithm on the CPU, NCCL's ring);
- tree all-reduce (NCCL's double binary tree, pipelined):
  ``2 ceil(log2 n) alpha + 2 m / bw``: fewer latencies, about the ring's bytes
  (with G GPUs per node: the tree spans the nodes, a pipelined chain each
  node's GPUs, ``+ 2 [(G-1) alpha_in + m / bw_in]``);
- hierarchical, G GPUs per node (M nodes): reduce-scatter inside the node,
  ring all-reduce of each GPU's 1/G across the nodes (the G rings share the
  node's interface, so m bytes cross it), all-gather inside the node:
  ``2 [(G-1) alpha_in + (G-1)/G m / bw_in] + 2 (M-1) alpha + 2 (M-1)/M m / bw``;
- ring all-gather of m bytes from each rank: ``(n-1) alpha + (n-1) m / bw``;
- the two halves of an all-reduce of m bytes, ``sharded``'s collectives
  (``Engine.reduce_scatter`` and ``Engine.all_gather_chunks``: Gloo's ring,
  (n-1)/n of the bucket leaves each rank in each): a reduce-scatter, then,
  separately, an all-gather of each rank's chunk, each half the all-reduce's
  time (``(n-1) alpha + (n-1)/n m / bw`` on the ring).

``sharing`` k > 1 says k jobs' transfers share every node's link: each runs
at the cluster simulator's contention law, ``1 / (k beta + (k-1) eta)``
(docs/cluster.md), with its 10 GbE ratio eta/beta.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hemiola.advise.profile import Param, cut_into
from hemiola.cluster.config import ClusterConfig

#: the engine's int8 and int4 codings: one scale per this many elements
INT8_BLOCK = 256
#: the block-scaled codings with error feedback, and their elements per byte
#: on the wire: at any number of ranks, a ring all-reduce's bytes of their
#: codes and scales (an all-to-all to each block's owner, then an all-gather
#: of the owners' averages coded again: cpp/src/engine/codec/block_coding.h)
BLOCK_CODED = {"int8": 1, "int4": 2}
#: decoupled's preview sums every rank's int8 codes in one byte
PREVIEW_MAX_WORLD = 127
#: the algorithms of all_reduce; "best" takes the fastest for each message
ALGORITHMS = ("ring", "tree", "hierarchical", "best")


@dataclass(frozen=True)
class Network:
    """N ranks and the links between them."""

    world: int
    #: bytes per second per rank (per node with several GPUs per node)
    bandwidth: float
    #: seconds per message between nodes
    latency: float = 25e-6
    gpus_per_node: int = 1
    #: inside a node (NVLink-class by default)
    intra_bandwidth: float = 150e9
    intra_latency: float = 5e-6
    algorithm: str = "ring"
    #: jobs whose transfers share each node's link
    sharing: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or self.gpus_per_node < 1 or self.sharing < 1:
            raise ValueError(f"world ({self.world}), gpus per node ({self.gpus_per_node}) and "
                             f"sharing ({self.sharing}) must be at least 1")
        if self.world > 1 and self.world % min(self.gpus_per_node, self.world):
            raise ValueError(f"{self.world} ranks do not fill nodes of {self.gpus_per_node} "
                             "GPUs: give a world size that is a multiple of --gpus-per-node")
        if not (self.bandwidth > 0 and self.intra_bandwidth > 0
                and math.isfinite(self.bandwidth) and math.isfinite(self.intra_bandwidth)):
            raise ValueError(f"bandwidths must be positive and finite, not {self.bandwidth!r} "
                             f"and {self.intra_bandwidth!r} bytes per second")
        if not (0 <= self.latency < math.inf and 0 <= self.intra_latency < math.inf):
            raise ValueError(f"latencies must be finite and >= 0, not {self.latency!r} and "
                             f"{self.intra_latency!r} seconds")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; known: "
                             f"{', '.join(ALGORITHMS)}")

    @property
    def nodes(self) -> int:
        return max(1, self.world // self.gpus_per_node)

    @property
    def inter_bandwidth(self) -> float:
        """What one transfer gets of a node's link under `sharing`."""
        k = self.sharing
        c = ClusterConfig()
        return self.bandwidth / (k + (k - 1) * c.eta_ms_per_mb / c.beta_ms_per_mb)


def ring(n: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def tree(n: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Pipelined double binary tree all-reduce of `nbytes` over `n` ranks."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * latency + 2 * nbytes / bandwidth


def all_reduce(net: Network, nbytes: float) -> float:
    """Seconds for one all-reduce of `nbytes` on `net`."""
    if net.world <= 1 or nbytes <= 0:
        return 0.0
    g = min(net.gpus_per_node, net.world)
    bw = net.inter_bandwidth
    flat_ring = ring(net.world, nbytes, net.latency, bw)
    # NCCL's tree: a pipelined chain inside each node, the tree across nodes
    flat_tree = tree(net.nodes, nbytes, net.latency, bw) + (
        2 * ((g - 1) * net.intra_latency + nbytes / net.intra_bandwidth) if g > 1 else 0.0)
    inside = 0.0 if g <= 1 else 2 * ((g - 1) * net.intra_latency
                                     + (g - 1) / g * nbytes / net.intra_bandwidth)
    hierarchical = inside + ring(net.nodes, nbytes, net.latency, bw)
    times = {"ring": flat_ring, "tree": flat_tree, "hierarchical": hierarchical}
    if net.algorithm == "best":
        return min(times.values())
    return times[net.algorithm]


def all_gather(net: Network, nbytes: float) -> float:
    """Seconds for a ring all-gather of `nbytes` from every rank."""
    if net.world <= 1 or nbytes <= 0:
        return 0.0
    return (net.world - 1) * (net.latency + nbytes / net.inter_bandwidth)


def reduce_scatter(net: Network, nbytes: float) -> float:
    """Seconds for a reduce-scatter of an `nbytes` bucket (each rank ends
    with its chunk summed): the first half of :func:`all_reduce`."""
    return all_reduce(net, nbytes) / 2


def all_gather_chunks(net: Network, nbytes: float) -> float:
    """Seconds for an all-gather of each rank's chunk of an `nbytes` bucket
    (every rank ends with the whole bucket): the second half of
    :func:`all_reduce`."""
    return all_reduce(net, nbytes) / 2


#: the collectives a payload names, and their seconds on a network
COLLECTIVES = {"all_reduce": all_reduce, "all_gather": all_gather,
               "reduce_scatter": reduce_scatter, "all_gather_chunks": all_gather_chunks}


def sent_bytes(kind: str, world: int, nbytes: float) -> float:
    """What one rank sends for a collective of `kind` over `nbytes`."""
    if world <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (world - 1) / world * nbytes
    if kind in ("reduce_scatter", "all_gather_chunks"):  # an all-reduce's half
        return (world - 1) / world * nbytes
    return (world - 1) * nbytes


@dataclass(frozen=True)
class Piece:
    """A parameter's share of one bucket."""

    numel: float
    element_size: int
    rows: float


def pieces(params: Sequence[Param], plan: Sequence[Sequence[int]]) -> list[list[Piece]]:
    """Each bucket of `plan` as pieces: a parameter that is in k buckets (cut
    into pieces) puts 1/k of its elements and rows in each."""
    count = cut_into(plan)
    return [[Piece(params[i].numel / count[i], params[i].element_size,
                   params[i].rows / count[i]) for i in bucket] for bucket in plan]


def payloads(coding: str, bucket: Sequence[Piece], world: int,
             powersgd_rank: int = 2) -> list[tuple[str, float]]:
    """The collectives one bucket makes under `coding`, in order, as
    (``"all_reduce"`` or ``"all_gather"``, bytes), as the engine's codecs
    send them (cpp/src/engine/codec). (``sharded``'s halves are made by
    :func:`hemiola.advise.model.jobs_for`.)"""
    plain = sum(p.numel * p.element_size for p in bucket if p.element_size != 4)
    floats = sum(p.numel for p in bucket if p.element_size == 4)
    out: list[tuple[str, float]] = []
    if coding == "none":
        out.append(("all_reduce", plain + 4 * floats))
    elif coding in ("fp16", "bf16"):
        out.append(("all_reduce", plain + 2 * floats))
    elif coding in BLOCK_CODED:
        if plain:
            out.append(("all_reduce", plain))
        out.append(("all_reduce", math.ceil(floats / BLOCK_CODED[coding])
                    + 4 * math.ceil(floats / INT8_BLOCK)))
    elif coding == "preview":
        if world > PREVIEW_MAX_WORLD:
            raise ValueError(f"the preview sums the ranks' int8 codes in one byte: at most "
                             f"{PREVIEW_MAX_WORLD} ranks, not {world}")
        if plain:
            out.append(("all_reduce", plain))
        out += [("all_gather", 4 * math.ceil(floats / INT8_BLOCK)),
                ("all_reduce", floats)]
    elif coding == "powersgd":
        uncompressed, p_size, q_size = float(plain), 0.0, 0.0
        for p in bucket:
            rows = round(p.rows)
            cols = p.numel / rows if rows > 1 else 0.0
            rank = min(powersgd_rank, rows, cols)
            if p.element_size == 4 and rows > 1 and cols > 1 and (rows + cols) * rank * 2 < \
                    p.numel:
                p_size += rows * rank * 4
                q_size += cols * rank * 4
            elif p.element_size == 4:
                uncompressed += 4 * p.numel
        out += [("all_reduce", b) for b in (uncompressed, p_size, q_size) if b > 0]
    else:
        raise ValueError(f"unknown coding {coding!r}")
    return [(kind, b) for kind, b in out if b > 0]


def wire(net: Network, payload: Sequence[tuple[str, float]]) -> float:
    """Seconds on the wire for `payload` (see :func:`payloads`; a kind of
    COLLECTIVES each)."""
    return sum(COLLECTIVES[kind](net, b) for kind, b in payload)


def sent(net: Network, payload: Sequence[tuple[str, float]]) -> float:
    """Bytes one rank sends for `payload`."""
    return sum(sent_bytes(kind, net.world, b) for kind, b in payload)
