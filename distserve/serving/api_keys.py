"""API keys: the ``serve --api-keys FILE`` key file, read into the tenants it names and the keys
that authenticate them (``ApiKeys``).

The file (YAML, or JSON when it ends in ``.json`` or starts with ``{``)::

    tenants:                     # name -> its TenantSpec fields (all optional)
      acme:   {weight: 2, tier: interactive, max_sessions: 8}
      nightly: {tier: batch, max_queued_requests: 1000, tokens_per_minute: 2000000}
    keys:                        # key -> tenant; several keys may name one tenant
      sk-acme-prod-2b7f0c9e41d8: acme
      sk-acme-ci-5a11f3e0c2b4: acme
      sk-nightly-c0ffee9d8e7a: nightly

Every mistake is refused when the server starts, naming the line: a YAML or JSON syntax error,
an unknown field, an unknown ``tier``, a weight or limit that is not positive, a tenant named
twice, a key listed twice, a key naming a tenant not under ``tenants``. ``anonymous`` (every
request without keys) and ``other`` (the metrics label of unknown tenants) are reserved names.

Keys are secrets: only their SHA-256 digest is kept, a presented key is compared with every
digest by ``hmac.compare_digest`` (constant time, no early exit), and no error message or repr
ever contains a key or part of one — a malformed key is named by its line only. Keys are
printable ASCII without spaces, at least ``MIN_KEY_CHARS`` long: a short key is guessable.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import hmac
import json
import json.decoder
import json.scanner
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distserve.cluster.tenants import ANONYMOUS, InvalidTenantError, TenantSpec
from distserve.errors import InvalidConfigError

MIN_KEY_CHARS = 16
OTHER_TENANT = "other"  # the metrics label every tenant outside the key file folds into
RESERVED_TENANTS = (ANONYMOUS, OTHER_TENANT)
TENANT_FIELDS = tuple(f.name for f in dataclasses.fields(TenantSpec) if f.name != "name")  # a tenant's fields in the file
_TOP_FIELDS = ("tenants", "keys")


class ApiKeyFileError(InvalidConfigError):
    """The key file is malformed; ``line`` (1-based) is where, when known. The message never holds a key."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message, "api_keys")
        self.line = line

    def __reduce__(self) -> tuple[type, tuple[str]]:  # type: ignore[override]
        return (type(self), (str(self),))


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The tenants of a key file and the digests of the keys naming them."""

    tenants: Mapping[str, TenantSpec]  # name -> spec, in file order
    digests: tuple[tuple[bytes, str], ...] = field(repr=False)  # (sha256 of a key, its tenant's name)

    @property
    def tenant_names(self) -> tuple[str, ...]:
        return tuple(self.tenants)

    def authenticate(self, key: str) -> TenantSpec | None:
        """The tenant ``key`` belongs to, or None. Every digest is compared, whatever matches, so the
        time taken says nothing about which key (or how much of one) was right."""
        presented = key_digest(key)
        found: str | None = None
        for digest, tenant in self.digests:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return self.tenants[found] if found is not None else None


# ---- reading the file: every mapping keeps the line of each of its keys ---------------------------
@dataclass
class _Map:
    """A mapping of the file: ``entries`` are (key, 1-based line of the key, value) in file order;
    a nested mapping's value is a ``_Map``, anything else plain data."""

    line: int
    entries: list[tuple[object, int, object]]


def _from_yaml(text: str) -> object:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:  # its str() quotes the offending line, which may hold a key: not used
        mark = exc.problem_mark or exc.context_mark
        raise ApiKeyFileError(f"not valid YAML: {exc.problem or exc.context}", mark.line + 1 if mark else None) from None
    except yaml.YAMLError as exc:
        raise ApiKeyFileError(f"not valid YAML ({type(exc).__name__})") from None
    constructor = yaml.SafeLoader("")

    def plain(node: yaml.Node) -> object:
        if isinstance(node, yaml.MappingNode):
            return _Map(node.start_mark.line + 1, [(plain(k), k.start_mark.line + 1, plain(v)) for k, v in node.value])
        if isinstance(node, yaml.SequenceNode):
            return [plain(item) for item in node.value]
        return constructor.construct_object(node, deep=True)

    return None if root is None else plain(root)


def _from_json(text: str) -> object:
    try:
        json.loads(text)  # syntax errors, named by json's own line
    except json.JSONDecodeError as exc:
        raise ApiKeyFileError(f"not valid JSON: {exc.msg} (column {exc.colno})", exc.lineno) from None
    line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]

    def line_of(pos: int) -> int:
        return bisect.bisect_right(line_starts, pos)

    def skip_ws(pos: int) -> int:
        while text[pos] in " \t\r\n":
            pos += 1
        return pos

    # json's pure-Python scanner, with objects parsed here so each key keeps its line; the text is
    # known to be valid JSON, so no syntax check is needed.
    def located_object(s_and_end: tuple[str, int], strict: bool, scan_once: Any, *_: Any) -> tuple[_Map, int]:
        _, pos = s_and_end
        found = _Map(line_of(pos - 1), [])
        pos = skip_ws(pos)
        while text[pos] != "}":
            key_line = line_of(pos)
            key, pos = json.decoder.scanstring(text, pos + 1, strict)
            value, pos = scan_once(text, skip_ws(skip_ws(pos) + 1))
            found.entries.append((key, key_line, value))
            pos = skip_ws(pos)
            if text[pos] == ",":
                pos = skip_ws(pos + 1)
        return found, pos + 1

    decoder = json.JSONDecoder()
    decoder.parse_object = located_object  # type: ignore[assignment]
    value, _ = json.scanner.py_make_scanner(decoder)(text, skip_ws(0))
    return value


def _fields(mapping: _Map, allowed: tuple[str, ...], where: str) -> dict[str, tuple[object, int]]:
    """``mapping``'s entries as field -> (value, line), each field one of ``allowed`` and given once."""
    fields: dict[str, tuple[object, int]] = {}
    for key, line, value in mapping.entries:
        if key not in allowed:
            raise ApiKeyFileError(f"{where}unknown field {str(key)!r:.80} (expected some of {', '.join(allowed)})", line)
        assert isinstance(key, str)
        if key in fields:
            raise ApiKeyFileError(f"{where}{key} given twice (first at line {fields[key][1]})", line)
        fields[key] = (value, line)
    return fields


def _tenant(name: object, line: int, value: object) -> TenantSpec:
    if not isinstance(name, str):
        raise ApiKeyFileError(f"a tenant name must be a string, got {type(name).__name__}", line)
    if name in RESERVED_TENANTS:
        raise ApiKeyFileError(f"tenant name {name!r} is reserved ({', '.join(RESERVED_TENANTS)})", line)
    if value is None:
        value = _Map(line, [])
    if not isinstance(value, _Map):
        raise ApiKeyFileError(f"tenant {name!r:.80} must map to its fields ({', '.join(TENANT_FIELDS)}), got {type(value).__name__}", line)
    fields = _fields(value, TENANT_FIELDS, f"tenant {name!r:.80}: ")
    try:
        return TenantSpec(name=name, **{k: v for k, (v, _) in fields.items()})  # type: ignore[arg-type]
    except InvalidTenantError as exc:
        at = fields[exc.param][1] if exc.param in fields else line
        raise ApiKeyFileError(f"tenant {name!r:.80}: {exc}", at) from None


def _check_key(key: object, line: int) -> str:
    """``key`` if it is a usable key; the error names only the line (never the key)."""
    if not isinstance(key, str):
        raise ApiKeyFileError(f"a key must be a string (quote it), got {type(key).__name__}", line)
    if len(key) < MIN_KEY_CHARS:
        raise ApiKeyFileError(f"a key must have at least {MIN_KEY_CHARS} characters (the key on this line has {len(key)})", line)
    if not all(33 <= ord(ch) <= 126 for ch in key):
        raise ApiKeyFileError("a key must be printable ASCII without spaces (the key on this line is not)", line)
    return key


def parse_api_keys(tree: object) -> ApiKeys:
    """``ApiKeys`` from a read file (see ``_Map``); ``ApiKeyFileError`` naming the line otherwise."""
    if tree is None:
        raise ApiKeyFileError("the file is empty: expected `keys:` (key -> tenant) and optionally `tenants:`")
    if not isinstance(tree, _Map):
        raise ApiKeyFileError(f"the file must be a mapping with `tenants:` and `keys:`, got {type(tree).__name__}", 1)
    sections = _fields(tree, _TOP_FIELDS, "")
    tenants: dict[str, TenantSpec] = {}
    tenant_lines: dict[str, int] = {}
    tenants_map, tenants_line = sections.get("tenants", (None, tree.line))
    if tenants_map is not None:
        if not isinstance(tenants_map, _Map):
            raise ApiKeyFileError("`tenants:` must map tenant names to their fields", tenants_line)
        for name, line, value in tenants_map.entries:
            spec = _tenant(name, line, value)
            if spec.name in tenants:
                raise ApiKeyFileError(f"tenant {spec.name!r} given twice (first at line {tenant_lines[spec.name]})", line)
            tenants[spec.name], tenant_lines[spec.name] = spec, line
    if "keys" not in sections:
        raise ApiKeyFileError("no `keys:` section (key -> tenant)")
    keys_map, keys_line = sections["keys"]
    if not isinstance(keys_map, _Map) or not keys_map.entries:
        raise ApiKeyFileError("`keys:` must map at least one key to its tenant", keys_line)
    digests: dict[bytes, tuple[str, int]] = {}
    for key, line, tenant in keys_map.entries:
        digest = key_digest(_check_key(key, line))
        if digest in digests:
            raise ApiKeyFileError(f"this key is listed twice (first at line {digests[digest][1]})", line)
        if not isinstance(tenant, str) or tenant not in tenants:
            known = ", ".join(tenants) or "none"
            raise ApiKeyFileError(f"the key on this line must name a tenant listed under `tenants:` ({known}), got {tenant!r:.80}", line)
        digests[digest] = (tenant, line)
    return ApiKeys(tenants, tuple((digest, tenant) for digest, (tenant, _) in digests.items()))


def load_api_keys(path: str | Path) -> ApiKeys:
    """Read and check the key file at ``path``; ``ApiKeyFileError`` naming the file and line otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyFileError(f"{path}: cannot read the key file: {getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    as_json = str(path).endswith(".json") or text.lstrip().startswith("{")
    try:
        return parse_api_keys(_from_json(text) if as_json else _from_yaml(text))
    except ApiKeyFileError as exc:
        located = ApiKeyFileError(f"{path}: {exc}")
        located.line = exc.line
        raise located from None


__all__ = ["ApiKeyFileError", "ApiKeys", "MIN_KEY_CHARS", "OTHER_TENANT", "RESERVED_TENANTS", "key_digest", "load_api_keys", "parse_api_keys"]
