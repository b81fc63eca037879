"""The first-token handoff's patches and views (``_vllm/first_token.py``).

The private vLLM 0.32 surface checked by name, and the patch or accessor checked on
vLLM's own objects.  With vLLM installed these tests fail, never skip: an ImportError
here is the likeliest sign of a vLLM upgrade.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm_sessionkv._vllm import first_token as vllm_first_token  # noqa: E402


def test_first_token_handoff_surface_exists():
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    assert {"prompt_token_ids", "prefill_token_ids", "req_id"} <= {
        f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_ids", "num_output_tokens"} <= {f.name for f in dataclasses.fields(CachedRequestData)}
    # Scheduler.update_from_output adds output tokens with this method, and the runner
    # gets a new request's prompt from NewRequestData.from_request (not the v2 runner's
    # prefill_token_ids, which first_token_unsupported rules out).
    assert "append_output_token_ids" in inspect.getsource(Scheduler._update_request_with_output)
    assert "prompt_token_ids=request.prompt_token_ids" in inspect.getsource(
        NewRequestData.from_request)
    for name in ("append_output_token_ids", "num_output_tokens", "use_structured_output",
                 "num_tokens"):
        assert hasattr(Request, name), name
    # A request loaded up to num_tokens - 1 computes one token; vLLM backs a load that
    # covers num_tokens off by one, which a handed-off request's load never does.
    assert "request.num_computed_tokens == request.num_tokens" in inspect.getsource(
        Scheduler._update_waiting_for_remote_kv)


def test_first_token_is_returned_with_the_first_output_and_shown_to_the_runner(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.core.sched import scheduler
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    def step_outputs():
        return {0: EngineCoreOutputs(outputs=[
            EngineCoreOutput(request_id="held", new_token_ids=[9]),
            EngineCoreOutput(request_id="other", new_token_ids=[4])])}

    monkeypatch.setattr(scheduler.Scheduler, "update_from_output",
                        lambda self, so, mro: step_outputs())
    monkeypatch.setattr(vllm_first_token, "_first_token_output_patched", False)
    appended: list[int] = []
    vllm_first_token.continue_from_token(
        SimpleNamespace(request_id="held", append_output_token_ids=appended.append), 5)
    assert appended == [5]
    first = scheduler.Scheduler.update_from_output(None, None, None)
    assert [o.new_token_ids for o in first[0].outputs] == [[5, 9], [4]]
    later = scheduler.Scheduler.update_from_output(None, None, None)
    assert [o.new_token_ids for o in later[0].outputs] == [[9], [4]]

    # The runner's view: the token ends the new request's prompt, and it is not
    # counted among the outputs it keeps.
    new = NewRequestData(req_id="held", prompt_token_ids=[1, 2, 3], mm_features=[],
                         sampling_params=None, pooling_params=None, block_ids=([0],),
                         num_computed_tokens=3, lora_request=None)
    plain = NewRequestData(req_id="plain", prompt_token_ids=[1, 2], mm_features=[],
                           sampling_params=None, pooling_params=None, block_ids=([1],),
                           num_computed_tokens=0, lora_request=None)
    cached = CachedRequestData(req_ids=["held", "plain"], resumed_req_ids=set(),
                               new_token_ids=[], all_token_ids={},
                               new_block_ids=[None, None], num_computed_tokens=[5, 3],
                               num_output_tokens=[3, 1])
    output = SimpleNamespace(scheduled_new_reqs=[new, plain], scheduled_cached_reqs=cached)
    vllm_first_token.show_first_tokens_to_worker(output, {"held": 5})
    assert new.prompt_token_ids == [1, 2, 3, 5] and plain.prompt_token_ids == [1, 2]
    assert cached.num_output_tokens == [2, 1]
