"""Fixtures for the serving tests: the single-process engine as the reference, the stacks
that several test files share, and a TCP proxy."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, running_stack


class Reference:
    """`hetero_pd.LLM` over the same model, in float32 as test stacks run (a deployment's
    default dtype): what the stack must answer, token for token."""

    def __init__(self, model: str | Path) -> None:
        self.llm = LLM(
            str(model), dtype="float32", num_kv_blocks=512, max_model_len=1024, num_threads=1
        )

    def texts(self, prompts: list[list[int]], params: SamplingParams) -> list[str]:
        return [o.outputs[0].text for o in self.llm.generate(prompts, params)]


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_dir: Path) -> Reference:
    return Reference(tiny_llama_dir)


@pytest.fixture(scope="session")
def reference_for() -> Callable[[Path], Reference]:
    """The Reference of any model folder, built once per folder."""
    cache: dict[Path, Reference] = {}

    def get(model: Path) -> Reference:
        if model not in cache:
            cache[model] = Reference(model)
        return cache[model]

    return get


@pytest.fixture(scope="session")
def text_chat_dir(
    text_llama_dir: Path, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny text model with the default model's chat template file too: a chat or tool
    request renders to the default model's prompt tokens, and only the (random) weights
    differ, so tests of what the server does with the output (grammars, tool calls, their
    parsing and streaming) run ~50x cheaper than on the default model."""
    folder = tmp_path_factory.mktemp("text-chat") / "model"
    shutil.copytree(text_llama_dir, folder)
    shutil.copy(default_model_dir / "chat_template.jinja", folder / "chat_template.jinja")
    return folder


#: The API key of the shared stacks below (their test files' `KEY`). They start once per
#: test process for every file that takes them, and `make test` runs those files in one
#: process (tests/conftest.py: SHARED_STACK_FILES).
SHARED_KEY = "k"


@pytest.fixture(scope="session")
def tiny_pd_stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    """1 prefill + 1 decode worker of the tiny Llama, API key SHARED_KEY. Its users assert
    deltas of the metrics and leave the workers idle (`wait_idle`), never counts since the
    start: other files' requests may come before theirs. Its workers are `python -m` ones
    (`fork_server: false`): test_control_plane reads their /proc/<pid>/environ and cmdline,
    and every file that reads this stack keeps the exec'd path serving."""
    dep = deployment(
        tiny_llama_dir, router={"api_keys": [SHARED_KEY]}, supervisor={"fork_server": False}
    )
    with running_stack(dep) as s:
        yield s


@pytest.fixture(scope="session")
def default_pd_stack(default_model_dir: Path) -> Iterator[Stack]:
    """1 prefill + 1 decode worker of the default model, no API key: the structured-output
    and embeddings files read it alike (deltas of the metrics, idle workers after)."""
    with running_stack(deployment(default_model_dir)) as s:
        yield s


@pytest.fixture(scope="session")
def default_colocated_stack(default_model_dir: Path) -> Iterator[Stack]:
    """One colocated worker of the default model, no API key: default_pd_stack's
    counterpart, read alike (deltas of the metrics, idle workers after)."""
    with running_stack(deployment(default_model_dir, workers=[{"role": "both"}])) as s:
        yield s


@pytest.fixture(scope="session")
def chat_colocated_stack(chat_model: Path) -> Iterator[Stack]:
    """One colocated worker of the tiny chat model, API key SHARED_KEY."""
    dep = deployment(chat_model, workers=[{"role": "both"}], router={"api_keys": [SHARED_KEY]})
    with running_stack(dep) as s:
        yield s


Relay = Callable[[bytes], bytes]


@asynccontextmanager
async def proxy(
    target: str,
    drop: Callable[[], bool] = lambda: False,
    up: Relay = lambda data: data,
    down: Relay = lambda data: data,
) -> AsyncIterator[str]:
    """A loopback TCP proxy to `target` (scheme://host:port), its URL (same scheme): it
    hangs up on each new connection while `drop()` holds, and passes the client's bytes
    through `up` and the server's through `down` (to record or alter them)."""
    scheme, address = target.split("://")
    host, port = address.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, f: Relay) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(f(data))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if drop():
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer, up), pipe(up_reader, writer, down))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()
