"""Inversion attacks on what an edge split sends: hidden states after layer k - 1 (and, in
`prompt_only` mode, the K/V rows of layers [0, k)). The attacker is the cloud operator: it
holds the model's weights and public text, never the device's prompts.

Attacks, each mapping one position's row to ranked token guesses:

    nearest neighbour   every candidate token pushed alone through layers [0, k) (position 0,
                        so attention over one key returns its own value: no context needed);
                        a sent row is matched to the closest of these by cosine. At k = 0 the
                        table is the embedding table itself, so it recovers every token.
    learned (linear)    ridge regression from rows to the token's input embedding, fitted on
                        public text run through the same layers; the predicted embedding is
                        matched to the whole embedding table by cosine.
    learned (MLP)       the same map with one hidden layer (GELU), trained with a cosine loss.

Only the scoring helpers here look at true token ids; the attacks see rows and weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edge.stack import EdgeStack
from hetero_pd.models.llama import Attention, DecoderLayer

TOP = 5


@dataclass(frozen=True, slots=True)
class Recovery:
    """Share of positions whose true token is the attack's first guess (top1) or among its
    first five (top5)."""

    top1: float
    top5: float
    positions: int


def score(guesses: torch.Tensor, truth: torch.Tensor) -> Recovery:
    """guesses: [n, >=5] token ids, best first; truth: [n] token ids."""
    hits = guesses[:, :TOP] == truth[:, None]
    n = int(truth.numel())
    return Recovery(float(hits[:, 0].float().mean()), float(hits.any(1).float().mean()), n)


def nearest(
    rows: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, chunk: int = 256
) -> torch.Tensor:
    """The TOP token ids of `ids` (one per table row) whose table rows are closest to each of
    `rows` by cosine: rows [n, d], table [c, d] -> [n, TOP]."""
    unit = F.normalize(table.float(), dim=-1)
    out = []
    for part in rows.float().split(chunk):
        sims = F.normalize(part, dim=-1) @ unit.T
        out.append(ids[sims.topk(min(TOP, unit.shape[0]), dim=-1).indices])
    return torch.cat(out)


@torch.inference_mode()
def token_tables(
    stack: EdgeStack, candidates: torch.Tensor, ks: Sequence[int], chunk: int = 2048
) -> dict[int, torch.Tensor]:
    """Each candidate token alone at position 0, run through layers [0, k): {k: [c, hidden]}
    for every k in `ks` (k <= stack.split_layer), computed in one pass up to max(ks)."""
    wanted, deepest = set(ks), max(ks)
    tables: dict[int, list[torch.Tensor]] = {k: [] for k in wanted}
    for part in candidates.split(chunk):
        h = stack.embed_tokens(part)
        for k in range(deepest + 1):
            if k in wanted:
                tables[k].append(h.clone())
            if k < deepest:
                h = _alone(stack.layers[k], h)
    return {k: torch.cat(rows) for k, rows in tables.items()}


def _alone(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One decoder layer on tokens that each see only themselves: attention's output is the
    token's own value row, spread over the query heads of its KV group."""
    assert isinstance(layer, DecoderLayer)
    attn = layer.self_attn
    assert isinstance(attn, Attention)
    v = attn.qkv_proj(layer.input_layernorm(x)).split(attn.split, dim=-1)[2]
    # v: [n, kv_heads, head_dim] -> [n, heads * head_dim]
    v = v.view(-1, attn.num_kv_heads, attn.head_dim)
    v = v.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1).flatten(1)
    x = x + attn.o_proj(v)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.inference_mode()
def value_table(stack: EdgeStack, candidates: torch.Tensor) -> torch.Tensor:
    """Layer 0's V row of each candidate: [c, kv_heads * head_dim]. It depends on the token
    alone (no context, no position), so matching a sent layer-0 V row to it is exact."""
    layer = stack.layers[0]
    assert isinstance(layer, DecoderLayer)
    attn = layer.self_attn
    assert isinstance(attn, Attention)
    x = layer.input_layernorm(stack.embed_tokens(candidates))
    return attn.qkv_proj(x).split(attn.split, dim=-1)[2]


@dataclass(frozen=True, slots=True)
class Capture:
    """What a split would send for some sequences: `hidden[k]` [n, hidden] per split k, the V
    rows of some layers `values[j]` [n, kv_heads * head_dim], and the true `ids` [n]."""

    hidden: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    ids: torch.Tensor


@torch.inference_mode()
def capture(
    stack: EdgeStack, sequences: Sequence[Sequence[int]], ks: Sequence[int], v_layers: Sequence[int]
) -> Capture:
    """Runs each sequence (positions 0..n-1) through the stack's layers, keeping the rows a
    split at each k in `ks` sends and the V rows of each layer in `v_layers`."""
    hidden: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    values: dict[int, list[torch.Tensor]] = {j: [] for j in v_layers}
    for seq in sequences:
        ids = torch.tensor(list(seq), dtype=torch.long)
        hs, _, vs = stack.layer_outputs(ids, torch.arange(len(seq)))
        for k in ks:
            hidden[k].append(hs[k])
        for j in v_layers:
            values[j].append(vs[j].flatten(1))
    ids = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
    return Capture(
        {k: torch.cat(v) for k, v in hidden.items()},
        {j: torch.cat(v) for j, v in values.items()},
        ids,
    )


def fit_linear(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-2) -> torch.Tensor:
    """Ridge regression x [n, d] -> y [n, e] with a bias; returns W [d + 1, e]. Features are
    scaled by their spread first, so one `ridge` suits layers whose scales differ by 100x."""
    xb = _with_bias(_standardize(x.double(), x.double()))
    gram = xb.T @ xb
    gram += ridge * len(x) * torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram, xb.T @ y.double()).float()


def apply_linear(w: torch.Tensor, x: torch.Tensor, train_x: torch.Tensor) -> torch.Tensor:
    """The fitted map on new rows (scaled by the training rows' spread, as in the fit)."""
    return _with_bias(_standardize(x.double(), train_x.double())).float() @ w


def _standardize(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (x - ref.mean(0)) / (ref.std(0) + 1e-6)


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x, torch.ones(len(x), 1, dtype=x.dtype)), dim=1)


def fit_mlp(
    x: torch.Tensor, y: torch.Tensor, *, width: int = 1024, steps: int = 300, seed: int = 0
) -> torch.nn.Module:
    """A two-layer MLP x -> y trained with a cosine loss (Adam, batches of 256); the returned
    module takes rows standardized like `x` (pass them through `standardize_like`)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], width), torch.nn.GELU(), torch.nn.Linear(width, y.shape[1])
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    xs = _standardize(x.float(), x.float())
    # Batches of 256 rows are too small to share among threads: on a busy 2-core host two
    # threads trained 15x slower than one (OpenMP workers waiting on each other).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.enable_grad():
            for _ in range(steps):
                batch = torch.randint(0, len(xs), (256,), generator=gen)
                loss = 1 - F.cosine_similarity(net(xs[batch]), y[batch].float(), dim=-1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return net.eval()


def standardize_like(x: torch.Tensor, train_x: torch.Tensor) -> torch.Tensor:
    return _standardize(x.float(), train_x.float())
