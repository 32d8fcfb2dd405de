"""Tags: headers -> tokenized IPC message -> Req -> meta_info, on the real SGLang types."""

from __future__ import annotations

import asyncio

import pytest
from sglang.srt.managers import io_struct
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager
from starlette.datastructures import Headers

from engine_patch.events import DECISIONS
from engine_patch.settings import EngineSettings
from engine_patch.tags import (
    TagError,
    TaggedGenerateReqInput,
    carry_tags_to_scheduler,
    echo_tags,
    place_echo_in_meta_info,
    read_request_tags,
    tag_req,
)
from tests.engine_patch.realparts import make_req

HEADERS = {"X-Isolation-Tenant": "tenant-a", "X-Isolation-Generation": "gen_01JD"}


class HttpRequestStandIn:
    """Only `.headers` of fastapi's Request is read; a real Request needs an ASGI scope."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = Headers(headers)


def generate_input(rid="gen_01JD", batch=False) -> GenerateReqInput:
    obj = GenerateReqInput(
        input_ids=[[1, 2, 3], [4, 5]] if batch else [1, 2, 3], rid=rid, sampling_params={}
    )
    obj.normalize_batch_and_arguments()
    return obj


def test_tags_are_read_from_headers_onto_the_request():
    obj = generate_input()
    read_request_tags(EngineSettings(), None, obj, HttpRequestStandIn(HEADERS))
    assert (obj.isogate_tenant, obj.isogate_generation) == ("tenant-a", "gen_01JD")


@pytest.mark.parametrize(
    ("headers", "rid", "batch", "message"),
    [
        ({"X-Isolation-Tenant": "tenant-a"}, "gen_01JD", False, "in pairs"),
        ({**HEADERS, "X-Isolation-Tenant": "bad tenant"}, "gen_01JD", False, "not a valid"),
        (HEADERS, "gen_OTHER", False, "rid must equal"),
        (HEADERS, "gen_01JD", True, "single"),
    ],
)
def test_bad_tags_are_refused_with_a_400_error_and_counted(headers, rid, batch, message):
    refused_before = DECISIONS.refused["bad_tags"]
    with pytest.raises(TagError, match=message) as raised:
        read_request_tags(
            EngineSettings(), None, generate_input(rid, batch), HttpRequestStandIn(headers)
        )
    assert raised.value.status_code == 400
    assert DECISIONS.refused["bad_tags"] == refused_before + 1


def test_untagged_requests_pass_unless_tags_are_required():
    read_request_tags(EngineSettings(), None, generate_input(), HttpRequestStandIn({}))
    with pytest.raises(TagError, match="requires isolation tags"):
        read_request_tags(
            EngineSettings(require_tags=True), None, generate_input(), HttpRequestStandIn({})
        )
    # SGLang's own health probe is never refused.
    read_request_tags(
        EngineSettings(require_tags=True), None, generate_input("HEALTH_CHECK_1"), None
    )


def test_tags_survive_sglang_msgpack_ipc_to_the_scheduler_and_land_on_req():
    obj = generate_input()
    read_request_tags(EngineSettings(), None, obj, HttpRequestStandIn(HEADERS))
    from array import array

    from sglang.srt.sampling.sampling_params import SamplingParams

    plain = io_struct.TokenizedGenerateReqInput(
        input_text="",
        input_ids=array("q", [1, 2, 3]),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        rid="gen_01JD",
        extra_key="salt",
    )
    tagged = carry_tags_to_scheduler(plain, None, obj)
    assert isinstance(tagged, TaggedGenerateReqInput)
    received = io_struct.msgpack_decode(io_struct.msgpack_encode(tagged))
    assert isinstance(
        received, io_struct.TokenizedGenerateReqInput
    )  # the scheduler dispatches it as one
    assert (received.isolation_tenant, received.isolation_generation, received.extra_key) == (
        "tenant-a",
        "gen_01JD",
        "salt",
    )
    req = make_req("gen_01JD", 3, tenant=None)
    tag_req(req, None, received)
    assert (req.isolation_tenant, req.isolation_generation) == ("tenant-a", "gen_01JD")


def test_untagged_messages_keep_sglangs_own_type():
    obj = generate_input()
    sentinel = object()
    assert carry_tags_to_scheduler(sentinel, None, obj) is sentinel


def test_echo_has_one_entry_per_emitted_request():
    tagged = make_req("gen_a", 4)
    tagged.isolation_verified = True
    untagged = make_req("plain", 4, tenant=None)
    echo = echo_tags(None, [tagged, untagged])
    assert echo == {
        "isolation_tenant": [["tenant-a"], []],
        "isolation_generation": [["gen_a"], []],
        "isolation_verified": [[True], []],
    }


def test_echo_lands_in_meta_info_as_scalars_on_every_chunk_and_other_keys_still_accumulate():
    manager = TokenizerManager.__new__(TokenizerManager)  # the method reads no instance state
    state = ReqState(
        out_list=[], finished=False, event=asyncio.Event(), obj=generate_input(), time_stats=None
    )
    customized = {
        "isolation_tenant": [["tenant-a"]],
        "isolation_generation": [["gen_01JD"]],
        "other": [[1, 2]],
    }
    for _chunk in range(2):
        meta_info: dict = {}
        place_echo_in_meta_info(
            TokenizerManager.update_request_meta_info,
            manager,
            meta_info,
            state,
            customized,
            0,
            None,
        )
        assert meta_info["isolation_tenant"] == "tenant-a"
        assert meta_info["isolation_generation"] == "gen_01JD"
    assert meta_info["other"] == [1, 2, 1, 2]  # SGLang's own accumulation, untouched
