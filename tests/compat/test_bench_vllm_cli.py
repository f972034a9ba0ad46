"""`hetero-pd bench serve` takes a `vllm bench serve` command line unchanged (only the
program name differs) and reads ShareGPT files; its result file has vLLM's keys."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hetero_pd.bench import datasets as ds
from hetero_pd.bench.serve import build_parser
from hetero_pd.bench.vllm_compat import normalize
from hetero_pd.cli import main
from hetero_pd.deploy.testing import deployment, running_stack

SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "What is the capital of France, and why?"},
            {"from": "gpt", "value": "Paris is the capital of France since long ago."},
        ],
    },
    {
        "id": "b",
        "conversations": [
            {"from": "human", "value": "Hi"},  # prompt too short: skipped
            {"from": "gpt", "value": "Hello there, how can I help you today?"},
        ],
    },
    {"id": "c", "conversations": [{"from": "human", "value": "only one turn"}]},  # skipped
    {
        "id": "d",
        "conversations": [
            {"from": "human", "value": "Name three colors of the rainbow please."},
            {"from": "gpt", "value": "Red, orange and yellow are three of them."},
            {"from": "human", "value": "and more?"},
        ],
    },
    {
        "id": "e",
        "conversations": [
            {"from": "human", "value": "Write one line about the sea and the sky."},
            {"from": "gpt", "value": "ok"},
        ],
    },  # answer too short: skipped
]
# vLLM's keys that dashboards and comparison scripts read from the result file.
VLLM_KEYS = {
    "date",
    "endpoint_type",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p99.9_ttft_ms",
    "p50_ttft_ms",
    "mean_tpot_ms",
    "p99.9_tpot_ms",
    "mean_itl_ms",
    "p50_itl_ms",
    "mean_e2el_ms",
    "p99.9_e2el_ms",
}


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    return path


def test_sharegpt_takes_first_turns_filters_like_vllm_and_cycles(sharegpt_file: Path) -> None:
    source = ds.WordText()
    reqs = ds.sharegpt_requests(sharegpt_file, source, n=5, seed=0)
    prompts = {r.prompt for r in reqs}
    assert prompts == {
        SHAREGPT[0]["conversations"][0]["value"],
        SHAREGPT[3]["conversations"][0]["value"],
    }
    by_prompt = {r.prompt: r for r in reqs}
    first = by_prompt[SHAREGPT[0]["conversations"][0]["value"]]
    assert first.max_tokens == source.count(SHAREGPT[0]["conversations"][1]["value"])
    assert first.prompt_len == source.count(first.prompt)
    assert len(reqs) == 5 and reqs[2] == reqs[0], "two usable pairs, cycled to n"
    fixed = ds.sharegpt_requests(sharegpt_file, source, n=3, output_len=2, seed=0)
    assert {r.max_tokens for r in fixed} == {2}
    assert len({r.prompt for r in fixed}) == 3, "a fixed output length keeps short answers"
    assert ds.sharegpt_requests(sharegpt_file, source, 5, seed=0) == reqs, "seeded order"


def test_bad_sharegpt_files_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="expected a ShareGPT list"):
        ds.sharegpt_requests(bad, ds.WordText(), 1)
    bad.write_text("[{")
    with pytest.raises(ValueError, match="not JSON"):
        ds.sharegpt_requests(bad, ds.WordText(), 1)
    bad.write_text(json.dumps([SHAREGPT[2]]))
    with pytest.raises(ValueError, match="no conversation has a usable"):
        ds.sharegpt_requests(bad, ds.WordText(), 1)


def _normalized(line: str) -> object:
    args = build_parser().parse_args(shlex.split(line))
    normalize(args)
    return args


def test_vllm_names_map_to_ours(sharegpt_file: Path, tmp_path: Path) -> None:
    args = _normalized(
        f"--backend openai-chat --host 10.0.0.1 --port 9000 --dataset-name custom "
        f"--dataset-path {sharegpt_file} --request-rate 3 --goodput ttft:100 --top-k 5 "
        f"--model {tmp_path} --served-model-name served"
    )
    assert (args.url, args.endpoint, args.dataset, args.rate) == (  # type: ignore[attr-defined]
        "http://10.0.0.1:9000",
        "chat",
        str(sharegpt_file),
        3.0,
    )
    assert args.slo == ["ttft:100"] and args.extra_body == {"top_k": 5}  # type: ignore[attr-defined]
    assert (args.model, args.tokenizer) == ("served", str(tmp_path))  # type: ignore[attr-defined]
    ours = _normalized("--url http://h:1/v1 --endpoint completions --dataset mixed --rate 2")
    assert (ours.url, ours.endpoint, ours.dataset) == ("http://h:1/v1", "completions", "mixed")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="needs --dataset-path"):
        _normalized("--dataset-name sharegpt")
    with pytest.raises(ValueError, match="--metric-percentiles"):
        _normalized("--metric-percentiles 50,abc")


@pytest.mark.timeout(300)
def test_a_vllm_bench_serve_command_line_runs_unchanged(
    text_llama_dir: Path, sharegpt_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    with running_stack(deployment(text_llama_dir)) as stack:
        vllm_line = (
            f"vllm bench serve --backend vllm --model {text_llama_dir} --base-url {stack.url} "
            f"--endpoint /v1/completions --dataset-name sharegpt --dataset-path {sharegpt_file} "
            "--num-prompts 6 --request-rate 50 --max-concurrency 3 --seed 1 "
            "--sharegpt-output-len 4 --ignore-eos --temperature 0 --goodput ttft:60000 tpot:60000 "
            "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99.9 --save-result "
            f"--save-detailed --result-dir {results} --metadata run=ci --trust-remote-code "
            "--disable-tqdm"
        )
        argv = shlex.split(vllm_line)
        assert argv[:3] == ["vllm", "bench", "serve"]
        code = main(argv[1:])  # `hetero-pd bench serve ...`: only the program differs
    out = capsys.readouterr().out
    assert code == 0, out
    (path,) = results.iterdir()
    assert path.name.startswith(f"vllm-50.0qps-concurrency3-{text_llama_dir.name}-")
    result = json.loads(path.read_text())
    assert set(result) >= VLLM_KEYS, VLLM_KEYS - set(result)
    assert result["completed"] == 6 and result["run"] == "ci"
    assert result["output_lens"] == [4] * 6 and result["total_output_tokens"] == 24
    assert result["request_goodput"] == pytest.approx(6 / result["duration"])
    assert result["p50_ttft_ms"] <= result["p99.9_ttft_ms"]
    assert len(result["ttfts"]) == len(result["itls"]) == 6
    assert result["model_id"] == str(text_llama_dir) == result["tokenizer_id"]
