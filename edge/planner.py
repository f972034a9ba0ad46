"""Split planner (Neurosurgeon / EdgeShard style): from per-layer latency profiles of the edge
and the cloud, the link's bandwidth and RTT and the codec's bytes per token, predict TTFT and
TPOT for every split layer k and recommend one. Pure functions; measuring is in
`edge.profiling`.

    TTFT(k) = edge prefill [0, k) + RTT + prompt hidden states / bandwidth
              + cloud prefill [k, L) + cloud head (final norm, LM head, one row)
    TPOT(k) = edge decode [0, k) + RTT + one hidden state / bandwidth
              + cloud decode [k, L) + cloud head
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from edge.codec import bytes_per_token
from edge.privacy import apply_floor

# msgpack framing and the session envelope around one hidden-state frame, in bytes.
FRAME_OVERHEAD_BYTES = 96


@dataclass(frozen=True, slots=True)
class SideProfile:
    """Per-layer latency of one side (seconds), measured at a few sequence lengths.

    `prefill_s[i][layer]`: that layer's time for a prompt of `seq_lens[i]` tokens;
    `decode_s[i][layer]`: its time for one new token after `seq_lens[i]` tokens of context;
    `head_s`: final norm + LM head for one row (counted on the cloud side only).
    """

    seq_lens: tuple[int, ...]
    prefill_s: tuple[tuple[float, ...], ...]
    decode_s: tuple[tuple[float, ...], ...]
    head_s: float = 0.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        n = len(self.seq_lens)
        if n == 0 or list(self.seq_lens) != sorted(set(self.seq_lens)) or self.seq_lens[0] < 1:
            raise ValueError(f"seq_lens must be distinct, ascending, >= 1: {self.seq_lens}")
        if len(self.prefill_s) != n or len(self.decode_s) != n:
            raise ValueError("prefill_s and decode_s need one row per sequence length")
        widths = {len(row) for row in (*self.prefill_s, *self.decode_s)}
        if len(widths) != 1 or 0 in widths:
            raise ValueError("every profile row must time the same, non-zero number of layers")

    @property
    def num_layers(self) -> int:
        return len(self.prefill_s[0])

    def prefill(self, start: int, end: int, num_tokens: int) -> float:
        """Seconds for layers [start, end) on a prompt of `num_tokens` tokens."""
        rows = [sum(row[start:end]) for row in self.prefill_s]
        return interpolate(self.seq_lens, rows, num_tokens)

    def decode(self, start: int, end: int, context: int) -> float:
        """Seconds for layers [start, end) on one token after `context` tokens."""
        rows = [sum(row[start:end]) for row in self.decode_s]
        return interpolate(self.seq_lens, rows, context, through_origin=False)

    def scaled(self, factor: float) -> SideProfile:
        """This profile on a device `factor` times slower (factor > 1) or faster."""
        if factor <= 0:
            raise ValueError(f"scale factor must be positive, got {factor}")

        def scale(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(t * factor for t in row) for row in rows)

        return replace(
            self,
            prefill_s=scale(self.prefill_s),
            decode_s=scale(self.decode_s),
            head_s=self.head_s * factor,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_lens": list(self.seq_lens),
            "prefill_s": [list(r) for r in self.prefill_s],
            "decode_s": [list(r) for r in self.decode_s],
            "head_s": self.head_s,
            "device": self.device,
        }


def interpolate(
    xs: Sequence[int], ys: Sequence[float], x: float, through_origin: bool = True
) -> float:
    """Piecewise-linear y(x) through the points, extrapolated linearly past the last two.

    With one point, prefill time is taken as proportional to the tokens (`through_origin`)
    and decode time as constant.
    """
    if len(xs) == 1:
        return ys[0] * x / xs[0] if through_origin else ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """The edge-cloud link: payload bandwidth in bytes per second and round-trip time."""

    bandwidth_bps: float
    rtt_s: float

    def __post_init__(self) -> None:
        if self.bandwidth_bps <= 0 or self.rtt_s < 0:
            raise ValueError(f"link needs bandwidth > 0 and rtt >= 0, got {self}")

    def round_trip(self, payload_bytes: int) -> float:
        """One request carrying `payload_bytes` and its (small) reply."""
        return self.rtt_s + payload_bytes / self.bandwidth_bps


@dataclass(frozen=True, slots=True)
class SplitPrediction:
    """Predicted latencies for one split layer (k = 0: the cloud runs every layer)."""

    split_layer: int
    ttft_s: float
    tpot_s: float
    edge_prefill_s: float
    link_prefill_s: float
    cloud_prefill_s: float
    edge_decode_s: float
    link_decode_s: float
    cloud_decode_s: float
    prompt_bytes: int
    bytes_per_token: int


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Every candidate's prediction; `best` minimizes the objective."""

    best: SplitPrediction
    candidates: tuple[SplitPrediction, ...]
    unsplit: SplitPrediction
    prompt_len: int
    codec: str
    objective: str
    #: Measured top-1 token recovery per k (when a floor was given) and the refused k's.
    recovery: Mapping[int, float] = field(default_factory=dict)
    refused: tuple[tuple[int, str], ...] = ()
    max_recovery: float | None = None


def predict(
    edge: SideProfile,
    cloud: SideProfile,
    link: LinkProfile,
    split_layer: int,
    prompt_len: int,
    token_bytes: int,
) -> SplitPrediction:
    """TTFT and TPOT of one split; `token_bytes` is what one position costs on the wire."""
    layers = cloud.num_layers
    if not 0 <= split_layer < layers or edge.num_layers < split_layer:
        raise ValueError(f"split layer {split_layer} is outside the profiled [0, {layers})")
    prompt_bytes = prompt_len * token_bytes + FRAME_OVERHEAD_BYTES
    step_bytes = token_bytes + FRAME_OVERHEAD_BYTES
    e_pre = edge.prefill(0, split_layer, prompt_len) if split_layer else 0.0
    e_dec = edge.decode(0, split_layer, prompt_len) if split_layer else 0.0
    l_pre, l_dec = link.round_trip(prompt_bytes), link.round_trip(step_bytes)
    c_pre = cloud.prefill(split_layer, layers, prompt_len) + cloud.head_s
    c_dec = cloud.decode(split_layer, layers, prompt_len) + cloud.head_s
    return SplitPrediction(
        split_layer=split_layer,
        ttft_s=e_pre + l_pre + c_pre,
        tpot_s=e_dec + l_dec + c_dec,
        edge_prefill_s=e_pre,
        link_prefill_s=l_pre,
        cloud_prefill_s=c_pre,
        edge_decode_s=e_dec,
        link_decode_s=l_dec,
        cloud_decode_s=c_dec,
        prompt_bytes=prompt_bytes,
        bytes_per_token=step_bytes,
    )


def plan_split(
    edge: SideProfile,
    cloud: SideProfile,
    link: LinkProfile,
    *,
    prompt_len: int,
    hidden_size: int,
    codec: str = "float16",
    candidates: Iterable[int] | None = None,
    objective: str = "ttft",
    output_tokens: int = 1,
    recovery: Mapping[int, float] | None = None,
    max_recovery: float | None = None,
) -> SplitPlan:
    """Recommends the split layer k in `candidates` (default 1..L-1: the edge keeps at least
    one layer, so no token ids leave it) minimizing `objective`: "ttft", or "latency" =
    TTFT + (output_tokens - 1) * TPOT. Ties go to the smaller k.

    With `max_recovery`, only the k whose measured top-1 token recovery (`recovery`, from a
    privacy profile) is at most that share are candidates; the others are listed as refused,
    and `PrivacyFloorError` says so when none is left."""
    if objective not in ("ttft", "latency"):
        raise ValueError(f"objective must be 'ttft' or 'latency', got {objective!r}")
    if edge.num_layers != cloud.num_layers:
        raise ValueError(f"profiles disagree: {edge.num_layers} vs {cloud.num_layers} layers")
    ks = sorted(set(candidates if candidates is not None else range(1, cloud.num_layers)))
    if not ks:
        raise ValueError("no candidate split layers")
    refused: list[tuple[int, str]] = []
    if max_recovery is not None:
        if recovery is None:
            raise ValueError("max_recovery needs the model's measured recovery (a privacy profile)")
        ks, refused = apply_floor(ks, recovery, max_recovery)
    token_bytes = bytes_per_token(hidden_size, codec)
    preds = tuple(predict(edge, cloud, link, k, prompt_len, token_bytes) for k in ks)

    def cost(p: SplitPrediction) -> float:
        extra = (output_tokens - 1) * p.tpot_s if objective == "latency" else 0.0
        return p.ttft_s + extra

    best = min(preds, key=lambda p: (cost(p), p.split_layer))
    # Unsplit: the cloud runs everything and receives token ids (4 bytes each).
    unsplit = predict(edge, cloud, link, 0, prompt_len, 4)
    rates = dict(recovery or {}) if max_recovery is not None else {}
    return SplitPlan(
        best, preds, unsplit, prompt_len, codec, objective, rates, tuple(refused), max_recovery
    )


def format_plan(plan: SplitPlan) -> str:
    """A table of every candidate (milliseconds) with the recommendation marked."""
    ms = 1000.0
    lines = [
        f"split planner: prompt {plan.prompt_len} tokens, codec {plan.codec}, "
        f"objective {plan.objective}",
        "    k  edge_pf  link_pf  cloud_pf     TTFT   edge_dc  link_dc  cloud_dc     TPOT",
    ]
    for p in (plan.unsplit, *plan.candidates):
        mark = "*" if p is plan.best else " "
        lines.append(
            f"{mark}{p.split_layer:4d}  {p.edge_prefill_s * ms:7.2f}  {p.link_prefill_s * ms:7.2f}"
            f"  {p.cloud_prefill_s * ms:8.2f}  {p.ttft_s * ms:7.2f}   {p.edge_decode_s * ms:7.2f}"
            f"  {p.link_decode_s * ms:7.2f}  {p.cloud_decode_s * ms:8.2f}  {p.tpot_s * ms:7.2f}"
        )
    b = plan.best
    for k, why in plan.refused:
        lines.append(f"refused k={k}: {why}")
    lines.append(
        f"recommended k={b.split_layer}: predicted TTFT {b.ttft_s * ms:.2f} ms, "
        f"TPOT {b.tpot_s * ms:.2f} ms, {b.prompt_bytes} B for the prompt, "
        f"{b.bytes_per_token} B per generated token (k=0 row: unsplit, sends token ids)"
    )
    if plan.max_recovery is not None:
        lines.append(
            f"privacy: measured top-1 token recovery at k={b.split_layer} is "
            f"{plan.recovery[b.split_layer]:.1%} (max allowed {plan.max_recovery:.1%})"
        )
    return "\n".join(lines)
