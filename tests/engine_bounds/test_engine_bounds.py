"""``gateway.openai.engine_bounds.FIELD_BOUNDS`` held against SGLang 0.5.23's own code.

For every field of the table that SGLang receives as a sampling parameter, the gateway's
smallest and largest accepted value (and its sentinels) goes through what a worker does with a
request, without error: the gateway's own parse and ``sampling_params``, then ``SamplingParams``
built as SGLang's server builds it from the request JSON, ``normalize`` with the model's
tokenizer (SGLang's own ``get_tokenizer``), ``verify`` with its vocabulary, the batch's
sampling tensors (``SamplingBatchInfo.from_schedule_batch``, penalizers prepared and fed the
token with the highest logit as the last output), and one sampling step by SGLang's
``Sampler`` on logits of a model's scale, down both of its CPU paths (plain, and the
top-k/top-p/min-p one). With deterministic inference on (it adds the int64 seed tensor) the
batch is built, not sampled: SGLang asserts there against min_p, a combination of its own.
One past either end is refused by the gateway's own validation. The objects are SGLang's; the
batch and the tensor-parallel group are stand-ins carrying the attributes read.

Token ids are bounded per model: the largest accepted is the vocabulary's last id, and the
table's type bound (int32) past it is refused by ``check_against``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import Sampler
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import _SAMPLING_EPS, SamplingParams
from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer
from sglang.test.test_utils import published_topology

from gateway.common.errors import APIError
from gateway.dev.model import DEFAULT_MODEL_DIR, ensure_tiny_model
from gateway.openai import protocol
from gateway.openai.engine_bounds import FIELD_BOUNDS, SAMPLING_EPS, Bound

# The fields SGLang receives beside the sampling parameters, or never (the gateway's fan-out).
NOT_SAMPLING = {name for name, bound in FIELD_BOUNDS.items() if bound.engine_name is None} | {
    "top_logprobs",
    "logprobs",
}
SAMPLING = {name: bound for name, bound in FIELD_BOUNDS.items() if name not in NOT_SAMPLING}
TOKEN_IDS = {"stop_token_ids", "logit_bias (token id)"}
# What sends a request down SGLang's top-k/top-p/min-p sampling path (where a NaN probability
# fails torch.multinomial, and the scheduler with it), at SGLang's smallest sampled temperature.
FULL_PATH = {"top_k": 5, "top_p": 0.5, "min_p": 0.05, "temperature": _SAMPLING_EPS}
# A model's logits are tens at most; the last output token is the most likely one.
LOGIT_SCALE = 30.0


@dataclass
class TensorParallelGroupStandIn:
    """One rank, no process group (the sampler syncs across ranks only when there are some)."""

    device_group: None = None


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


@contextlib.contextmanager
def worker_context(deterministic: bool) -> Iterator[None]:
    """SGLang's runtime context as a CPU worker publishes it (deterministic inference adds the
    int64 seed tensor). Publishing resets SGLang's process-wide context, before and after, so
    the tensor-parallel rank that tests/engine_patch states once for the process is restored
    (the suite's modules run in an order of their own: tests/conftest.py)."""
    try:
        tp_rank = get_parallel().tp_rank
    except RuntimeError:
        tp_rank = None  # never stated in this process
    try:
        with published_topology(
            device="cpu",
            sampling_backend="pytorch",  # what a CPU server resolves "auto" to
            enable_deterministic_inference=deterministic,
        ):
            get_parallel().override_permanently(tp_group=TensorParallelGroupStandIn())
            yield
    finally:
        if tp_rank is not None:
            get_parallel().override_permanently(tp_rank=tp_rank)


@pytest.fixture(params=[False, True], ids=["sampling", "deterministic"])
def deterministic(request: pytest.FixtureRequest) -> Iterator[bool]:
    with worker_context(request.param):
        yield request.param


@pytest.fixture
def sampling_worker() -> Iterator[None]:
    with worker_context(False):
        yield


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


def run_in_sglang(
    params: dict[str, Any], tokenizer: Any, vocab_size: int, *, sample: bool = True
) -> SamplingBatchInfo:
    """What a worker does with one request's sampling parameters, up to a sampled token."""
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
    if sample:
        # As ModelRunner.sample: the penalties and biases, then the sampler.
        logits = torch.linspace(-LOGIT_SCALE, LOGIT_SCALE, vocab_size).view(1, vocab_size)
        info.apply_logits_bias(logits)
        token = Sampler()(
            LogitsProcessorOutput(next_token_logits=logits),
            info,
            False,
            [0],
            [None],
            torch.tensor([3]),
        )
        assert 0 <= int(token[0]) < vocab_size
    return info


def accepted_values(name: str, bound: Bound, vocab_size: int) -> list[int | float]:
    largest = vocab_size - 1 if name in TOKEN_IDS else bound.largest()
    return [bound.smallest(), largest, *bound.sentinels]


@pytest.mark.parametrize(("name", "bound"), SAMPLING.items(), ids=SAMPLING.keys())
def test_every_value_the_gateway_accepts_survives_sglangs_request_batch_and_sampler(
    deterministic: bool, tokenizer: Any, vocab_size: int, name: str, bound: Bound
) -> None:
    for value in accepted_values(name, bound, vocab_size):
        params = through_the_gateway(name, value, vocab_size)
        run_in_sglang(params, tokenizer, vocab_size, sample=not deterministic)
        if not deterministic:
            run_in_sglang({**FULL_PATH, **params}, tokenizer, vocab_size)


def test_the_tables_sampling_epsilon_is_sglangs() -> None:
    assert SAMPLING_EPS == _SAMPLING_EPS


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
    deterministic: bool, tokenizer: Any, vocab_size: int, params: dict[str, Any]
) -> None:
    """What the table prevents: SGLang's verify passes these, and the batch's int32 tensors
    cannot hold them (in a worker, the scheduler process dies)."""
    with pytest.raises(RuntimeError, match="int32"):
        run_in_sglang(params, tokenizer, vocab_size, sample=False)


def test_a_repetition_penalty_under_the_bound_kills_sglangs_sampler(
    sampling_worker: None, tokenizer: Any, vocab_size: int
) -> None:
    """What the table prevents: SGLang's verify takes any penalty above 0, and the sampler
    divides the last token's logit by it in float32; at 5e-324 (0 in float32) the logit is
    infinite, the probabilities NaN, and torch.multinomial fails (in a worker, the scheduler
    process dies: a decode worker did, on the real pair)."""
    with pytest.raises(RuntimeError, match="probability tensor"):
        run_in_sglang({**FULL_PATH, "repetition_penalty": 5e-324}, tokenizer, vocab_size)
