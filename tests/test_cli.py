"""`distserve generate`: output formats and clear errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from distserve.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "5", "--json", "--ignore-eos")
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    assert len(data["token_ids"]) == 5 and isinstance(data["text"], str)
    assert data["ttft_s"] > 0 and data["tpot_s"] >= 0 and data["finish_reason"] == "length"


def test_generate_text_and_chat(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "3", "--chat", "--temperature", "0.7", "--seed", "1")
    assert code == 0 and out.endswith("\n")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--prompt-file-too-long"], "tokens"),
    ],
)
def test_generate_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    base = ["generate", "--model", "tiny", "--prompt", "hi"]
    if argv == ["--prompt-file-too-long"]:
        argv = ["--prompt", "x" * 3000]
    code, _, err = run(capsys, *base, *argv)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_bad_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "many"])
    assert exc.value.code == 2


def test_numeric_flag_types_refuse_what_they_do_not_take() -> None:
    """``distserve.cli.arg_types``: each type takes its values (as numbers) and refuses the rest with a
    message argparse prefixes with the flag (NaN and infinities included)."""
    import argparse

    from distserve.cli.arg_types import at_least_one, fraction, non_negative_float, non_negative_int, positive_float, positive_int

    cases = [(positive_int, ["1", "64"], ["0", "-3", "1.5", "x"]),
             (non_negative_int, ["0", "3"], ["-1", "0.5", "x"]),
             (positive_float, ["0.5", "3", "1e-3"], ["0", "-1", "nan", "inf", "-inf", "x"]),
             (non_negative_float, ["0", "2.5"], ["-0.1", "nan", "inf", "x"]),
             (at_least_one, ["1", "2.5"], ["0.99", "0", "nan", "inf", "x"]),
             (fraction, ["0.9", "1"], ["0", "1.01", "nan", "x"])]
    for kind, good, bad in cases:
        for text in good:
            assert kind(text) == float(text)
        for text in bad:
            with pytest.raises(argparse.ArgumentTypeError, match="must be"):
                kind(text)
