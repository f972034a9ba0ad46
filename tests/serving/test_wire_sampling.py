"""Sampling values on the control wire: `WireParams` carries every `SamplingParams` field,
bounded; logprob positions round-trip through a frame."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest

from hetero_pd import SamplingParams, StructuredOutputsParams
from hetero_pd.outputs import Logprob
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.control import values as V

#: Every field away from its default, so a field the wire dropped would show.
ALL_SET = SamplingParams(
    n=3,
    max_tokens=7,
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.05,
    seed=11,
    stop=["\n\n", "END"],
    stop_token_ids=[2, 3],
    ignore_eos=True,
    min_tokens=2,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.3,
    logit_bias={5: 2.5, 9: -100.0},
    logprobs=4,
    prompt_logprobs=1,
    structured_outputs=StructuredOutputsParams(json={"type": "object", "required": ["a"]}),
)


def test_wire_params_mirror_sampling_params_field_for_field() -> None:
    assert list(P.WireParams.__struct_fields__) == [
        f.name for f in dataclasses.fields(SamplingParams)
    ]
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        assert getattr(ALL_SET, f.name) != getattr(defaults, f.name), f.name


def test_every_field_survives_a_frame() -> None:
    codec, router_side = P.worker_codec(), P.router_codec()
    msg = P.Generate(rid="r", prompt_ids=[1, 2], params=P.WireParams.of(ALL_SET))
    got = codec.decode(router_side.encode(msg))
    assert got.params.to_params() == ALL_SET


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {i: 1.0 for i in range(W.MAX_LOGIT_BIAS + 1)}),
        ("n", 129),
        ("structured_outputs", {"kind": "xml", "spec": "<a/>"}),
        ("structured_outputs", {"kind": "regex", "spec": "a" * (65 * 1024)}),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    params = msgspec.structs.asdict(P.WireParams())
    frame = msgspec.msgpack.encode(
        {"v": 2, "t": "generate", "rid": "r", "prompt_ids": [1], "params": {**params, field: value}}
    )
    with pytest.raises(V.MessageError, match=field):
        P.worker_codec().decode(frame)


def test_logprob_positions_round_trip_in_order() -> None:
    entry = {9: Logprob(-3.0, 4), 1: Logprob(-0.1, 1), 2: Logprob(-math.inf, 2)}
    msg = P.Output(
        rid="r",
        seq=0,
        text="x",
        token_ids=[9],
        logprobs=[W.position(entry)],
        prompt_logprobs=[None, W.position(entry)],
    )
    got = P.router_codec().decode(P.worker_codec().encode(msg))
    assert got == msg
    back = W.entries(got.logprobs)[0]
    assert list(back) == [9, 1, 2] and back == entry
    assert W.prompt_entries(got.prompt_logprobs) == [None, entry]


def test_a_position_is_bounded() -> None:
    too_many = [[t, -1.0, 1] for t in range(W.MAX_LOGPROBS + 2)]
    frame = msgspec.msgpack.encode(
        {"v": 2, "t": "output", "rid": "r", "seq": 0, "text": "", "token_ids": [1],
         "logprobs": [too_many]}
    )  # fmt: skip
    with pytest.raises(V.MessageError, match="logprobs"):
        P.router_codec().decode(frame)
