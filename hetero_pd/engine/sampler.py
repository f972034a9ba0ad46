"""Token sampling: greedy, temperature, top-k, top-p and min-p, with per-request seeds,
after the grammar mask (structured outputs) and the logits processors (bans, bias,
penalties), with logprobs where asked."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from hetero_pd.engine.logits_processors import History, process_logits
from hetero_pd.engine.logprobs import token_logprobs
from hetero_pd.engine.request import Request
from hetero_pd.engine.stop import suppressed_token_ids
from hetero_pd.engine.structured import TokenMasks, allowed, apply_bitmask
from hetero_pd.outputs import Logprob
from hetero_pd.sampling_params import SamplingParams

# Rows with top-p but no top-k first look for their nucleus among this many most likely
# tokens (a partial top-k is ~10x cheaper than sorting a 49k vocab on CPU) and fall back to a
# full sort only when those do not hold top_p of the probability mass.
TOP_P_CANDIDATES = 1024


def top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that survive top-k then top-p, as sorted candidates.

    Args:
        logits: ``[num_rows, vocab]`` float logits (already divided by the temperature).
        top_k: ``[num_rows]`` integers; ``<= 0`` or ``>= vocab`` disables top-k for the row.
            Tokens tied with the k-th largest logit are kept.
        top_p: ``[num_rows]`` floats in ``(0, 1]``; ``1`` disables top-p for the row. Keeps
            the smallest set of most likely tokens whose probability (after top-k) sums to
            at least ``top_p``; the most likely token is always kept.

    Returns:
        ``(values, token_ids)``, both ``[num_rows, width]``: each row's ``width`` most likely
        tokens in descending order, values of dropped ones set to ``-inf``. Tokens beyond
        ``width`` are all dropped.
    """
    vocab = logits.shape[-1]
    k = [kk if 0 < kk < vocab else 0 for kk in top_k.tolist()]
    p = top_p.tolist()
    p_only = [kk == 0 and pp < 1.0 for kk, pp in zip(k, p, strict=True)]
    need = max(max(k), TOP_P_CANDIDATES if any(p_only) else 0)
    unmasked = any(kk == 0 and pp >= 1.0 for kk, pp in zip(k, p, strict=True))
    if not unmasked and (need + 1) * 2 < vocab:
        vals, ids = logits.topk(need + 1, dim=-1)
        masked, exact = _mask_sorted(vals, logits, k, top_p, p_only, windowed=True)
        if exact:
            return masked, ids
    vals, ids = logits.sort(dim=-1, descending=True)
    masked, _ = _mask_sorted(vals, logits, k, top_p, p_only, windowed=False)
    return masked, ids


def _mask_sorted(
    vals: torch.Tensor,
    logits: torch.Tensor,
    k: list[int],
    top_p: torch.Tensor,
    p_only: list[bool],
    windowed: bool,
) -> tuple[torch.Tensor, bool]:
    """Masks sorted candidate ``vals``; also says whether the window held every kept token."""
    device = vals.device
    width = vals.shape[-1]
    k_eff = torch.tensor([kk or width for kk in k], device=device)
    kth = vals.gather(1, (k_eff - 1).unsqueeze(1))
    exact = True
    if windowed:
        # A top-k row is exact unless its last candidate ties with its k-th (more ties outside).
        has_k = torch.tensor([kk > 0 for kk in k], device=device)
        exact = not bool((has_k & (vals[:, -1] >= kth[:, 0])).any())
    masked = vals.masked_fill(vals < kth, float("-inf"))

    p = top_p.to(device=device, dtype=vals.dtype)
    if not bool((p < 1.0).any()):
        return masked, exact
    # Unnormalized probabilities relative to the top token: elementwise, so a row's result
    # does not depend on the window width or the other rows.
    weights = (masked - vals[:, :1]).exp()
    cum = weights.cumsum(dim=-1)
    total = cum[:, -1].clone()
    if windowed and any(p_only):
        rows = [i for i, flag in enumerate(p_only) if flag]
        total[rows] = (logits[rows] - vals[rows, :1]).exp().sum(dim=-1)
        exact = exact and bool((cum[rows, -1] >= p[rows] * total[rows]).all())
    target = (p * total).unsqueeze(1)
    # Token j is dropped when the tokens ranked above it already reach p; column 0 never is.
    drop = torch.zeros_like(masked, dtype=torch.bool)
    drop[:, 1:] = (cum[:, :-1] >= target) & (p < 1.0).unsqueeze(1)
    return masked.masked_fill(drop, float("-inf")), exact


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Return a copy of ``logits`` with the tokens outside top-k and top-p set to ``-inf``.

    Same arguments and rules as :func:`top_k_top_p_candidates`.
    """
    vals, ids = top_k_top_p_candidates(logits, top_k, top_p)
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, vals)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below ``min_p`` times each row's largest one (not renormalized).

    Args:
        probs: ``[num_rows, vocab]`` probabilities, normalized or not.
        min_p: ``[num_rows]`` floats in ``[0, 1]``; ``0`` disables it for the row.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs).unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


class Sampler:
    """Samples one token per row of a ``[num_seqs, vocab]`` logits tensor, float32 or the
    model's dtype: greedy rows take the maximum of the values as they are (a bf16 value
    widened to float32 is the same value), the rest is computed in float32.

    The logits first go through ``logits_processors.process_logits`` (min_tokens bans,
    logit_bias, penalties; rows that ask for none keep their values). Greedy rows
    (``params.greedy``) then take the argmax, bit-exact with transformers' greedy search.
    Other rows: divide by the temperature, mask with top-k, top-p and min-p (in that order),
    then sample by exponential race, ``argmax(probs / q)`` with ``q ~ Exponential(1)`` per
    token. A row whose generator is not ``None`` draws one noise value per vocabulary token
    from that generator only, so its samples depend only on its seed and its own logits,
    not on the rest of the batch; the other rows share one draw from the global RNG.

    Rows of requests with a grammar (``Request.grammar``) are masked before anything else:
    only the tokens the grammar allows keep their logits; the matcher then advances over
    the sampled token.
    """

    def __init__(self) -> None:
        self._masks = TokenMasks()

    def start_masks(self, reqs: Sequence[Request]) -> Future[torch.Tensor] | None:
        """Starts computing the grammar masks of ``reqs`` (one logits row each) on a
        background thread; None when no request has a grammar. Call before the forward pass
        and pass the result to ``sample_requests``."""
        return self._masks.start([r.grammar for r in reqs])

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        suppress_token_ids: list[list[int]] | None = None,
        histories: list[History] | None = None,
    ) -> list[int]:
        """Return the sampled token id of each row.

        Args:
            logits: ``[num_seqs, vocab]`` logits of the last position of each sequence.
            params: one ``SamplingParams`` per row.
            generators: one per row; ``torch.Generator`` (any device) for seeded requests,
                created once per request and passed at every step, else ``None``.
            suppress_token_ids: optional, per row, token ids that must not be sampled
                (see ``stop.suppressed_token_ids``: EOS and ``stop_token_ids`` before
                ``min_tokens``). Applies to greedy rows too.
            histories: per row, ``(prompt token ids, output token ids)``; needed when a
                row has a penalty.
        """
        return self.sample(logits, params, generators, suppress_token_ids, histories)[0]

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        suppress_token_ids: list[list[int]] | None = None,
        histories: list[History] | None = None,
    ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """As ``__call__``, and per row the logprobs entry (None where not asked)."""
        num_seqs = logits.shape[0]
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"expected one SamplingParams and one generator per logits row ({num_seqs}), "
                f"got {len(params)} params and {len(generators)} generators"
            )
        logits = process_logits(logits, params, suppress_token_ids, histories)
        tokens = self._choose(logits, params, generators)
        return tokens, _logprobs(logits, params, tokens)

    @torch.inference_mode()
    def sample_requests(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        masks: Future[torch.Tensor] | None = None,
    ) -> list[int]:
        """Samples the next token of each request (one logits row each), records the
        logprobs of those that ask for them on the request and advances their grammars.
        ``masks``: what ``start_masks(reqs)`` returned (started here when not given)."""
        if masks is None:
            masks = self._masks.start([r.grammar for r in reqs])
        bitmask = masks.result() if masks is not None else None
        if bitmask is not None:
            rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
            logits = logits.clone()
            logits[rows] = apply_bitmask(logits[rows], bitmask[rows])
        params = [r.params for r in reqs]
        suppress = [
            suppressed_token_ids(r.params, r.num_output_tokens, r.eos_token_ids) for r in reqs
        ]
        histories: list[History] | None = None
        if any(p.has_penalties for p in params):
            histories = [(r.prompt_token_ids, r.output_token_ids) for r in reqs]
        tokens, logprobs = self.sample(
            logits, params, [r.generator for r in reqs], suppress, histories
        )
        for row, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            if req.grammar is not None and bitmask is not None and not allowed(bitmask, row, token):
                raise ValueError(
                    f"request {req.request_id}: no token is both allowed by its grammar and "
                    "by its other sampling parameters (min_tokens, stop_token_ids, logit_bias)"
                )
        for req, token in zip(reqs, tokens, strict=True):
            if req.grammar is not None:
                req.grammar.accept(token)
        for req, token, entry in zip(reqs, tokens, logprobs, strict=True):
            if entry is not None:
                req.output_logprobs.append(entry)
                req.cumulative_logprob += entry[token].logprob
        return tokens

    def _choose(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        num_seqs = logits.shape[0]
        greedy = [p.greedy for p in params]
        if all(greedy):
            return _greedy(logits)

        tokens = _greedy(logits) if any(greedy) else [0] * num_seqs
        rows = [i for i, g in enumerate(greedy) if not g]
        temperature = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        x = logits[rows].float().div_(temperature.unsqueeze(1))
        vocab = logits.shape[-1]
        uses_masks = [0 < params[i].top_k < vocab or params[i].top_p < 1.0 for i in rows]
        masked = [j for j, m in enumerate(uses_masks) if m]
        plain = [j for j, m in enumerate(uses_masks) if not m]
        for group, use_masks in ((plain, False), (masked, True)):
            if not group:
                continue
            group_params = [params[rows[j]] for j in group]
            group_gens = [generators[rows[j]] for j in group]
            sampled = _sample(_take(x, group), group_params, group_gens, use_masks)
            for j, token in zip(group, sampled, strict=True):
                tokens[rows[j]] = token
        return tokens


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[dict[int, Logprob] | None]:
    """Logprobs entries of the rows that ask: log-softmax after the temperature (1 for greedy
    rows), before top-k/top-p/min-p."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[dict[int, Logprob] | None] = [None] * len(params)
    if not rows:
        return out
    temperature = [1.0 if params[i].greedy else params[i].temperature for i in rows]
    t = torch.tensor(temperature, device=logits.device).unsqueeze(1)
    lp = torch.log_softmax(logits[rows].float() / t, dim=-1)
    entries = token_logprobs(lp, [tokens[i] for i in rows], [params[i].logprobs or 0 for i in rows])
    for i, entry in zip(rows, entries, strict=True):
        out[i] = entry
    return out


def _greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of its maxima, as `argmax`): through `max`, whose bf16
    reduction on CPU took 0.93 ms at [64, 49152] where `argmax`'s took 5.2."""
    return logits.max(dim=-1).indices.tolist()


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return x if len(rows) == x.shape[0] else x[rows]


def _sample(
    x: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    use_masks: bool,
) -> list[int]:
    """Sample each row of temperature-scaled float32 logits ``x`` by exponential race."""
    device = x.device
    vocab = x.shape[-1]
    ids: torch.Tensor | None = None
    if use_masks:
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        x, ids = top_k_top_p_candidates(x, top_k, top_p)
        weights = (x - x[:, :1]).exp_()
    else:
        weights = (x - x.amax(dim=-1, keepdim=True)).exp_()
    # Unnormalized probabilities with max 1: the race and min-p are scale-invariant per row.
    if any(p.min_p > 0.0 for p in params):
        weights = apply_min_p(weights, torch.tensor([p.min_p for p in params], device=device))

    noise = _exponential_noise(weights.shape, generators, ids, vocab, device)
    choice = weights.div_(noise).argmax(dim=-1)
    if ids is not None:
        choice = ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    return choice.tolist()


def _exponential_noise(
    shape: torch.Size,
    generators: list[torch.Generator | None],
    ids: torch.Tensor | None,
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """Exponential(1) noise for ``[rows, width]`` weights whose token ids are ``ids``.

    Unseeded rows get fresh global-RNG noise for just their width. A seeded row always draws
    one value per vocabulary token from its generator and takes the values of its candidates
    by token id, so what it consumes and samples is independent of the batch.
    """
    # -log(U) is Exponential(1) and faster than exponential_(); U == 0 gives +inf, which
    # only makes that token lose.
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.rand(shape, device=device).log_().neg_()
    noise = torch.empty(shape, device=device)
    if unseeded:
        noise[unseeded] = torch.rand((len(unseeded), shape[1]), device=device).log_().neg_()
    for row, gen in enumerate(generators):
        if gen is None:
            continue
        # Drawn on the generator's own device so a CPU generator also serves GPU logits.
        row_noise = torch.rand(vocab, device=gen.device, generator=gen).log_().neg_().to(device)
        noise[row] = row_noise if ids is None else row_noise[ids[row]]
    return noise


def advance_generator(generator: torch.Generator, vocab_size: int) -> None:
    """Consumes the draws one non-greedy sample takes from a seeded row's generator.

    A decode worker calls it for the first token, which the prefill worker sampled, so a
    seeded request yields the same tokens disaggregated as in one engine."""
    torch.rand(vocab_size, device=generator.device, generator=generator)
