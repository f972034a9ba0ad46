"""Serving benchmarks: an OpenAI-API load generator with SLO attainment and goodput.

Modules, in the order a run uses them:

- ``datasets``: the prompts (random, chat + summarization mix, JSONL file);
- ``arrivals``: when each request is sent (Poisson / gamma arrivals);
- ``client``: one streaming request, timed chunk by chunk (SSE parsing);
- ``runner``: one run (schedule, concurrency cap, progress bar);
- ``metrics``: per-request results -> throughput, latency percentiles, goodput;
- ``sweep``: the binary search for goodput over request rates;
- ``report`` and ``plots``: the summary table and the PNGs;
- ``serve``: the ``hetero-pd bench serve`` command line (``main``);
- ``compare``: result files side by side (used by ``scripts/vllm_side_by_side.sh``).

Whole-system benchmarks, each a ``hetero-pd bench`` command of its own: ``offline`` (the
engine against transformers), ``pd`` (disaggregated against colocated serving), ``edge``
(the edge split against the unsplit stack, over loopback or a link shaped by ``link_shaping``)
and ``edge-privacy`` (inversion attacks on what the split sends; ``edge_agreement`` prices the
codec and noise in greedy agreement); ``decode-step`` (float32 against bfloat16, the decode
attention kernel on and off), ``profile`` (a prefill and a decode step's time by category
against the GEMM rate, float32 and bfloat16) and ``per-token`` (detokenizing and SSE
encoding, old and new).
"""
