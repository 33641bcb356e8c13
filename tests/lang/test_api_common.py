"""The plumbing the API backends share: SDK errors as BackendError, usage counts, chat checks
(sgnb/backends/_api_common.py), and select from fetched logprobs (sgnb/backends/_select.py)."""

from __future__ import annotations

import threading

import pytest

from sgnb.backends._api_common import (
    Usage,
    api_errors,
    check_assistant_turn,
    check_one_sample,
    status_message,
    token_counts,
)
from sgnb.backends._select import select_by_logprobs
from sgnb.backends.base import BackendError, GenContext
from sgnb.sampling import GenParams


class _SDKError(Exception):
    pass


class _StatusError(_SDKError):
    def __init__(self, status_code: int, body, message: str = "sdk message") -> None:
        super().__init__(message)
        self.status_code, self.body, self.message = status_code, body, message


@pytest.mark.parametrize("body, shown", [
    ({"error": {"message": "bad key", "type": "auth"}}, "bad key"),  # OpenAI's and Anthropic's shape
    ({"message": "overloaded"}, "overloaded"),
    ({"error": "weird"}, "sdk message"),
    (None, "sdk message"),
])
def test_status_errors_name_the_servers_message(body, shown):
    assert status_message(_StatusError(401, body)) == shown
    with pytest.raises(BackendError, match=f"^completion failed: HTTP 401: {shown}$") as info:
        with api_errors("completion", _StatusError, _SDKError):
            raise _StatusError(401, body)
    assert isinstance(info.value.__cause__, _StatusError)


def test_other_sdk_errors_and_foreign_ones():
    with pytest.raises(BackendError, match="^chat failed: connection refused$"):
        with api_errors("chat", _StatusError, _SDKError):
            raise _SDKError("connection refused")
    with pytest.raises(KeyError):  # not the SDK's: not ours to translate
        with api_errors("chat", _StatusError, _SDKError):
            raise KeyError("x")


def test_usage_is_a_dict_added_to_from_threads():
    usage = Usage("spec_hits")
    assert usage == {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "spec_hits": 0}

    class Counts:
        prompt_tokens, completion_tokens = 3, None

    def work():
        for _ in range(500):
            usage.add({"calls": 1, **token_counts(Counts())})

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert usage == {"calls": 2000, "prompt_tokens": 6000, "completion_tokens": 0, "spec_hits": 0}
    assert token_counts(None) == {"prompt_tokens": 0, "completion_tokens": 0}


def test_chat_checks():
    check_assistant_turn(GenContext("", [], "r", in_role="assistant"))
    check_assistant_turn(GenContext("", [], "r"))
    with pytest.raises(BackendError, match="inside 'user': put it inside assistant"):
        check_assistant_turn(GenContext("", [], "r", in_role="user"))
    check_one_sample(GenParams(n=1), "X")
    with pytest.raises(BackendError, match="n > 1 is not supported on the X backend"):
        check_one_sample(GenParams(n=2), "X")


def test_select_by_logprobs():
    ctx = GenContext("Answer:", [], "r")
    rows = {" yes": [(-9.0, 1, ":"), (-0.5, 2, " yes")], " no": [(-9.0, 1, ":"), (-2.0, 3, " no")]}
    calls: list[str] = []

    def conditional():
        calls.append("conditional")
        return [rows[c] for c in (" yes", " no")]

    def unconditional(scored):
        calls.append("unconditional")
        return [[(None, e[1], e[2]) for e in row] for row in scored]

    decision = select_by_logprobs(ctx, [" yes", " no"], "token_length_normalized", conditional, unconditional)
    assert decision.decision == " yes" and decision.meta_info["choices"] == [" yes", " no"]
    assert calls == ["conditional"]
    decision = select_by_logprobs(ctx, [" yes", " no"], "unconditional_likelihood_normalized", conditional,
                                  unconditional)
    assert decision.decision == " yes" and calls[-1] == "unconditional"
    assert "normalized_unconditional_prompt_logprobs" in decision.meta_info
    with pytest.raises(BackendError, match="non-empty prefix"):
        select_by_logprobs(GenContext("", [], "r"), ["a"], "token_length_normalized", conditional, unconditional)
    with pytest.raises(ValueError, match="choices_method"):
        select_by_logprobs(ctx, ["a"], "nope", conditional, unconditional)
    with pytest.raises(BackendError, match="leaves no token.*, from here"):
        select_by_logprobs(ctx, ["a"], "token_length_normalized", lambda: [[]], unconditional, ", from here")
