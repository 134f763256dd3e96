"""The ``serve --api-keys`` key file: tenants and keys read from YAML or JSON, every mistake refused
naming its line, and keys never shown — not in errors, reprs or the CLI's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distserve.cluster.tenants import TenantSpec
from distserve.errors import InvalidConfigError
from distserve.serving import api_keys as api_keys_module
from distserve.serving.api_keys import ApiKeyFileError, load_api_keys

ACME_KEY = "sk-acme-prod-2b7f0c9e41d8"
ACME_CI_KEY = "sk-acme-ci-5a11f3e0c2b4aa"
NIGHTLY_KEY = "sk-nightly-c0ffee9d8e7a"
GOOD_YAML = f"""\
tenants:
  acme: {{weight: 2, tier: interactive, max_sessions: 8}}
  nightly:
    tier: batch
    max_queued_requests: 1000
    tokens_per_minute: 2000000
  idle:
keys:
  {ACME_KEY}: acme
  {ACME_CI_KEY}: acme
  {NIGHTLY_KEY}: nightly
"""


def write(tmp_path: Path, text: str, name: str = "keys.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(tmp_path: Path, text: str, name: str = "keys.yaml") -> ApiKeyFileError:
    with pytest.raises(ApiKeyFileError) as info:
        load_api_keys(write(tmp_path, text, name))
    message = str(info.value)
    for key in (ACME_KEY, ACME_CI_KEY, NIGHTLY_KEY, "sk-secret"):
        assert key not in message, message
    return info.value


def test_a_yaml_key_file_maps_keys_to_tenants(tmp_path: Path) -> None:
    keys = load_api_keys(write(tmp_path, GOOD_YAML))
    assert keys.tenants == {
        "acme": TenantSpec("acme", weight=2, tier="interactive", max_sessions=8),
        "nightly": TenantSpec("nightly", tier="batch", max_queued_requests=1000, tokens_per_minute=2_000_000),
        "idle": TenantSpec("idle"),
    }
    assert keys.tenant_names == ("acme", "nightly", "idle")
    assert keys.authenticate(ACME_KEY) is keys.tenants["acme"]
    assert keys.authenticate(ACME_CI_KEY) is keys.tenants["acme"]  # several keys, one tenant
    assert keys.authenticate(NIGHTLY_KEY) is keys.tenants["nightly"]
    for wrong in ("", ACME_KEY[:-1], ACME_KEY + "x", ACME_KEY.upper(), "sk-idle-0000000000000000"):
        assert keys.authenticate(wrong) is None
    shown = repr(keys)  # only digests are kept, and not even they are shown
    assert ACME_KEY not in shown and "digest" not in shown and keys.digests[0][0].hex() not in shown


def test_the_same_file_as_json_gives_the_same_keys(tmp_path: Path) -> None:
    data = {
        "tenants": {"acme": {"weight": 2, "tier": "interactive", "max_sessions": 8},
                    "nightly": {"tier": "batch", "max_queued_requests": 1000, "tokens_per_minute": 2000000}, "idle": None},
        "keys": {ACME_KEY: "acme", ACME_CI_KEY: "acme", NIGHTLY_KEY: "nightly"},
    }
    from_json = load_api_keys(write(tmp_path, json.dumps(data, indent=2), "keys.json"))
    assert from_json == load_api_keys(write(tmp_path, GOOD_YAML))


def test_every_presented_key_is_compared_with_every_digest_in_constant_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = load_api_keys(write(tmp_path, GOOD_YAML))
    compared: list[tuple[bytes, bytes]] = []
    real = api_keys_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", counting)
    assert keys.authenticate(ACME_KEY) is not None  # the first key: no early exit after the match
    assert len(compared) == 3 and all(len(a) == len(b) == 32 for a, b in compared)


@pytest.mark.parametrize(("text", "line", "words"), [
    ("tenants:\n  acme: {tier: batch\nkeys:\n  sk-secret-0000000000: acme\n", 3, "not valid YAML"),
    (f"tenants:\n  acme: {{}}\nkeys:\n  {ACME_KEY}: acme\n   bad: x\n", 5, "not valid YAML"),
    ("tenants:\n  acme:\n    weight: 1\n    tier: urgent\nkeys: {}\n", 4, "tier must be one of interactive, default, batch, got 'urgent'"),
    ("tenants:\n  acme:\n    weight: -1\n", 3, "weight must be a positive number, got -1"),
    ("tenants:\n  acme:\n    weight: 0\n", 3, "weight must be a positive number"),
    ("tenants:\n  acme:\n    max_sessions: 0\n", 3, "max_sessions must be null or an integer >= 1"),
    ("tenants:\n  acme:\n    wieght: 2\n", 3, "unknown field 'wieght'"),
    ("tenants:\n  acme:\n    tier: batch\n    tier: default\n", 4, "tier given twice (first at line 3)"),
    ("tenants:\n  acme: {}\n  acme: {}\n", 3, "tenant 'acme' given twice (first at line 2)"),
    ("tenants:\n  anonymous: {}\n", 2, "reserved"),
    ("tenants:\n  other: {}\n", 2, "reserved"),
    ("tenants:\n  acme: 3\n", 2, "must map to its fields"),
    ("tenant:\n  acme: {}\n", 1, "unknown field 'tenant' (expected some of tenants, keys)"),
    ("keys: {}\nkeys: {}\n", 2, "keys given twice (first at line 1)"),
    (f"tenants:\n  acme: {{}}\nkeys:\n  {ACME_KEY}: acme\n  {ACME_KEY}: acme\n", 5, "this key is listed twice (first at line 4)"),
    (f"tenants:\n  acme: {{}}\nkeys:\n  {ACME_KEY}: acmee\n", 4, "must name a tenant listed under `tenants:` (acme), got 'acmee'"),
    (f"keys:\n  {ACME_KEY}: acme\n", 2, "must name a tenant listed under `tenants:` (none)"),
    ("tenants:\n  acme: {}\nkeys:\n  sk-secret: acme\n", 4, "at least 16 characters"),
    ("tenants:\n  acme: {}\nkeys:\n  123456789012345678901: acme\n", 4, "a key must be a string (quote it)"),
    ("tenants:\n  acme: {}\nkeys:\n  \"sk-secret-with space-0\": acme\n", 4, "printable ASCII without spaces"),
    ("tenants:\n  acme: {}\nkeys: {}\n", 3, "at least one key"),
])
def test_a_bad_yaml_file_is_refused_naming_the_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    err = refused(tmp_path, text)
    assert err.line == line and f"keys.yaml: line {line}: " in str(err) and words in str(err), str(err)


@pytest.mark.parametrize(("text", "line", "words"), [
    ('{"tenants": {"acme": {"tier": "batch"}}\n "keys": {}}', 2, "not valid JSON: Expecting ',' delimiter"),
    ('{\n "tenants": {\n  "acme": {\n   "weight": -2}},\n "keys": {"sk-secret-0000000000": "acme"}}', 4, "weight must be a positive number"),
    ('{"tenants": {"acme": {}},\n "keys": {\n  "sk-secret-0000000000": "acme",\n  "sk-secret-0000000000": "acme"}}', 4, "listed twice (first at line 3)"),
    ('{"tenants": {"acme": {}, "acme": {"tier": "batch"}}}', 1, "given twice"),
    ('[1, 2]', 1, "must be a mapping"),
])
def test_a_bad_json_file_is_refused_naming_the_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    err = refused(tmp_path, text, "keys.json")
    assert err.line == line and words in str(err), str(err)


def test_an_empty_or_missing_file_is_refused(tmp_path: Path) -> None:
    assert "empty" in str(refused(tmp_path, "# nothing\n"))
    assert "no `keys:` section" in str(refused(tmp_path, "tenants:\n  acme: {}\n"))
    with pytest.raises(ApiKeyFileError, match="cannot read the key file"):
        load_api_keys(tmp_path / "missing.yaml")


def test_serve_refuses_a_bad_key_file_with_exit_2_naming_the_flag_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from distserve.cli import main

    path = write(tmp_path, f"tenants:\n  acme: {{weight: -1}}\nkeys:\n  {ACME_KEY}: acme\n")
    assert main(["serve", "--model", "tiny", "--port", "0", "--api-keys", str(path)]) == 2  # before any model loads
    out = capsys.readouterr()
    assert f"distserve serve: error: --api-keys {path}: line 2: tenant 'acme': weight must be a positive number" in out.err
    assert "Traceback" not in out.err and ACME_KEY not in out.err + out.out


def test_ray_serve_app_args_load_the_key_file(tmp_path: Path) -> None:
    from distserve.serving.app_config import ServeAppConfig

    app = ServeAppConfig.from_args({"model": "tiny", "api_keys": str(write(tmp_path, GOOD_YAML))}).resolve()
    assert app.api_keys is not None and app.api_keys.authenticate(NIGHTLY_KEY) == TenantSpec("nightly", tier="batch",
                                                                                              max_queued_requests=1000,
                                                                                              tokens_per_minute=2_000_000)
    assert {t.name for t in app.deployment.admission.tenants} == set(app.api_keys.tenant_names)
    with pytest.raises(InvalidConfigError, match="app config: api_keys .*line 3: tenant 'acme': weight"):
        ServeAppConfig.from_args({"api_keys": str(write(tmp_path, "tenants:\n  acme:\n    weight: -1\n", "bad.yaml"))}).resolve()
