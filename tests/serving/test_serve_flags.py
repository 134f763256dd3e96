"""`distserve serve`'s vLLM flags: --chat-template, --max-model-len, --max-num-seqs, --max-num-batched-tokens and the
CORS flags. Bad values exit 2 naming the flag; a real server process deploys what they say."""

from __future__ import annotations

import pathlib

import httpx
import pytest

from distserve.cli import main
from serving_util import serve_process, stop_process

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.mark.parametrize("argv, needle", [
    (["--chat-template", "templates/missing.jinja"], "--chat-template"),
    (["--chat-template", "{% if %}"], "--chat-template"),
    (["--allow-credentials"], "--allowed-origins"),
    (["--allowed-methods", '["GET"]'], "--allowed-origins"),
    (["--ray-serve", "--chat-template", "templates/missing.jinja"], "--chat-template"),  # before Ray starts
    (["--ray-serve", "--request-read-timeout", "5"], "--request-read-timeout"),
])
def test_bad_combinations_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert main(["serve", "--model", "tiny", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--max-model-len", "4x"], "--max-model-len"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "-2k"], "--max-num-batched-tokens"),
    (["--allowed-origins", '["a", 1]'], "--allowed-origins"),
    (["--allowed-headers", "[not json"], "--allowed-headers"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
    (["--h11-max-header-count", "-1"], "--h11-max-header-count"),
    (["--request-read-timeout", "x"], "--request-read-timeout"),
])
def test_bad_values_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "tiny", *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.integration  # runs `distserve serve` as a process
@pytest.mark.timeout(120)
def test_the_flags_deploy(tmp_path: pathlib.Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = ("--threads", "1", "--colocated", "1", "--chat-template", str(template), "--max-model-len", "256", "--max-num-seqs", "2",
             "--max-num-batched-tokens", "128", "--allowed-origins", '["http://app.example"]')
    with serve_process(*flags) as (proc, url):
        assert httpx.get(f"{url}/ping").status_code == 200
        models = httpx.get(f"{url}/v1/models", headers={"Origin": "http://app.example"})
        assert models.json()["data"][0]["max_model_len"] == 256
        assert models.headers["access-control-allow-origin"] == "http://app.example"
        chat = [{"role": "user", "content": "hi"}]
        tokens = httpx.post(f"{url}/tokenize", json={"messages": chat}).json()
        assert tokens["max_model_len"] == 256
        text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == "<user>hi<assistant>"  # the --chat-template file, not the tokenizer's
        # n above --max-num-seqs cannot be batched; a prompt past --max-model-len does not fit.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 300, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": chat, "max_tokens": 2, "n": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        _, err = stop_process(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
