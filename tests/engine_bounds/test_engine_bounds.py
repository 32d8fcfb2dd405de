"""``gateway.openai.engine_bounds.FIELD_BOUNDS`` held against SGLang 0.5.23's own code.

For every field of the table that SGLang receives as a sampling parameter, the gateway's
smallest and largest accepted value (and its sentinels) goes through what a worker does with a
request, without error: ``SamplingParams`` built as SGLang's server builds it from the request
JSON, ``normalize`` with the model's tokenizer (SGLang's own ``get_tokenizer``), ``verify``
with its vocabulary, then the batch's sampling tensors (``SamplingBatchInfo.
from_schedule_batch``, penalizers prepared and fed an output token), with deterministic
inference off and on (which adds the int64 seed tensor). One past either end is refused by the
gateway's own validation. The objects are SGLang's; only the batch is a stand-in carrying the
two attributes ``from_schedule_batch`` reads.

Token ids are bounded per model: the largest accepted is the vocabulary's last id, and the
table's type bound (int32) past it is refused by ``check_against``.
"""

from __future__ import annotations

import inspect
import json
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer
from sglang.test.test_utils import published_topology

from gateway.common.errors import APIError
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from gateway.openai import protocol
from gateway.openai.engine_bounds import FIELD_BOUNDS, Bound

# The fields SGLang receives beside the sampling parameters, or never (the gateway's fan-out).
NOT_SAMPLING = {name for name, bound in FIELD_BOUNDS.items() if bound.engine_name is None} | {
    "top_logprobs",
    "logprobs",
}
SAMPLING = {name: bound for name, bound in FIELD_BOUNDS.items() if name not in NOT_SAMPLING}
TOKEN_IDS = {"stop_token_ids", "logit_bias (token id)"}


class ScheduleBatchStandIn:
    """The two attributes of a ScheduleBatch that ``from_schedule_batch`` reads (a real one
    needs a loaded model); weak-referenceable, as the penalizers hold it."""

    def __init__(self, reqs: list[Req]) -> None:
        self.reqs = reqs
        self.device = "cpu"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_tokenizer(str(ensure_tiny_model(DEFAULT_MODEL_DIR)))


@pytest.fixture(scope="module")
def vocab_size(tokenizer: Any) -> int:
    return len(tokenizer)


@pytest.fixture(params=[False, True], ids=["sampling", "deterministic"])
def worker(request: pytest.FixtureRequest) -> Iterator[None]:
    """SGLang's runtime context as a CPU worker publishes it (deterministic inference adds the
    int64 seed tensor). Publishing resets SGLang's process-wide context, before and after, so
    the tensor-parallel rank that tests/engine_patch states once for the process is restored
    (the suite's modules run in an order of their own: tests/conftest.py)."""
    try:
        tp_rank = get_parallel().tp_rank
    except RuntimeError:
        tp_rank = None  # never stated in this process
    try:
        with published_topology(device="cpu", enable_deterministic_inference=request.param):
            yield
    finally:
        if tp_rank is not None:
            get_parallel().override_permanently(tp_rank=tp_rank)


def client_fields(name: str, value: Any) -> dict[str, Any]:
    """A chat request with the table's field ``name`` at ``value``."""
    fields: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if name == "logit_bias (token id)":
        fields["logit_bias"] = {str(value): 1.0}
    elif name == "logit_bias (bias)":
        fields["logit_bias"] = {"5": value}
    elif name == "stop_token_ids":
        fields["stop_token_ids"] = [value]
    else:
        fields[name] = value
    if name == "min_tokens":
        fields["max_tokens"] = max(value, 1)
    return fields


def through_the_gateway(name: str, value: Any, vocab_size: int) -> dict[str, Any]:
    """The sampling parameters the gateway sends for ``name`` at ``value``, as SGLang's server
    reads them from the request's JSON (or the gateway's 400)."""
    body = json.dumps(client_fields(name, value)).encode()
    parsed = protocol.parse_request(body, protocol.ChatCompletionRequest)
    max_tokens = parsed.requested_max_tokens or 16
    parsed.check_against(vocab_size, max_tokens)
    loaded: dict[str, Any] = json.loads(json.dumps(parsed.sampling_params(max_tokens)))
    return loaded


def run_in_sglang(params: dict[str, Any], tokenizer: Any, vocab_size: int) -> SamplingBatchInfo:
    """What a worker does with one request's sampling parameters, up to its first sampling."""
    sampling = SamplingParams(**params)
    sampling.normalize(tokenizer)
    sampling.verify(vocab_size)
    req = Req("bounds", "", array("q", [1, 2, 3]), sampling)
    req.tokenizer = tokenizer
    batch = ScheduleBatchStandIn([req])
    info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size)
    orchestrator = info.penalizer_orchestrator
    assert orchestrator is not None
    orchestrator.cumulate_output_tokens(torch.tensor([vocab_size - 1]))
    return info


def accepted_values(name: str, bound: Bound, vocab_size: int) -> list[int | float]:
    largest = vocab_size - 1 if name in TOKEN_IDS else bound.largest()
    return [bound.smallest(), largest, *bound.sentinels]


@pytest.mark.parametrize(("name", "bound"), SAMPLING.items(), ids=SAMPLING.keys())
def test_every_value_the_gateway_accepts_survives_sglangs_request_and_batch(
    worker: None, tokenizer: Any, vocab_size: int, name: str, bound: Bound
) -> None:
    for value in accepted_values(name, bound, vocab_size):
        params = through_the_gateway(name, value, vocab_size)
        info = run_in_sglang(params, tokenizer, vocab_size)
        assert len(info) == 1


@pytest.mark.parametrize(("name", "bound"), SAMPLING.items(), ids=SAMPLING.keys())
def test_one_past_either_end_is_refused_by_the_gateway(
    vocab_size: int, name: str, bound: Bound
) -> None:
    for value in bound.just_past():
        with pytest.raises(APIError) as caught:
            through_the_gateway(name, value, vocab_size)
        assert caught.value.status == 400


@pytest.mark.parametrize("name", sorted(TOKEN_IDS))
def test_a_token_id_past_the_vocabulary_is_refused_by_the_gateway(
    vocab_size: int, name: str
) -> None:
    for value in (vocab_size, FIELD_BOUNDS[name].largest()):
        with pytest.raises(APIError) as caught:
            through_the_gateway(name, value, vocab_size)
        assert caught.value.status == 400


def test_the_most_log_probabilities_fit_the_pd_transfer() -> None:
    """Prefill hands a request's first token and its alternatives to decode in a fixed-width
    buffer; more alternatives than it holds fail the transfer."""
    width = inspect.signature(MetadataBuffers.__init__).parameters["max_top_logprobs_num"].default
    assert FIELD_BOUNDS["top_logprobs"].largest() <= width
    assert FIELD_BOUNDS["logprobs"].largest() <= width


@pytest.mark.parametrize(
    "params",
    [{"top_k": 2**31}, {"top_k": 10**18}, {"min_new_tokens": 2**31, "max_new_tokens": 2**31}],
    ids=["top_k past int32", "top_k 10**18", "min_new_tokens past int32"],
)
def test_past_the_dtype_sglang_itself_fails_building_the_batch(
    worker: None, tokenizer: Any, vocab_size: int, params: dict[str, Any]
) -> None:
    """What the table prevents: SGLang's verify passes these, and the batch's int32 tensors
    cannot hold them (in a worker, the scheduler process dies)."""
    with pytest.raises(RuntimeError, match="int32"):
        run_in_sglang(params, tokenizer, vocab_size)
