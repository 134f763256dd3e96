"""``StreamedSoFar``: a re-run from scratch continues a stream exactly where the client is, or fails if it diverges."""

from __future__ import annotations

import pytest

from distserve.engine.outputs import RequestMetrics, RequestOutput
from distserve.errors import ServiceUnavailableError
from distserve.runtime.rerun import StreamedSoFar


def out(ids: list[int], new: int, finished: bool = False, index: int = 0) -> RequestOutput:
    text = "".join(chr(97 + i) for i in ids)
    return RequestOutput("r", [1, 2], ids, text, ids[-new:] if new else [], text[-new:] if new else "", finished,
                         "length" if finished else None, RequestMetrics(0.0, None, None, 2, 0, len(ids)), index=index)


def test_a_rerun_skips_what_was_streamed_and_cuts_new_fields_to_the_rest() -> None:
    so_far = StreamedSoFar()
    for o in (out([0, 1], 2), out([0, 1, 2], 1)):
        assert so_far.continue_with(o) is o
        so_far.record(o)
    assert so_far.continue_with(out([0, 1], 2)) is None  # the re-run catching up
    assert so_far.continue_with(out([0, 1, 2], 1)) is None
    cont = so_far.continue_with(out([0, 1, 2, 3, 4], 2))
    assert cont is not None and cont.new_token_ids == [3, 4] and cont.new_text == "de" and cont.token_ids == [0, 1, 2, 3, 4]
    so_far.record(cont)
    done = so_far.continue_with(out([0, 1, 2, 3, 4], 0, finished=True))  # the finish, with no new token
    assert done is not None and done.finished and done.new_token_ids == []
    assert so_far.continue_with(out([7], 1, index=1)) is not None  # another completion of n > 1: nothing streamed yet


@pytest.mark.parametrize("rerun", [out([0, 5], 2), out([0], 1, finished=True)])
def test_a_rerun_with_other_tokens_fails_clearly(rerun: RequestOutput) -> None:
    so_far = StreamedSoFar()
    so_far.record(out([0, 1, 2], 3))
    with pytest.raises(ServiceUnavailableError, match="other tokens"):
        so_far.continue_with(rerun)
