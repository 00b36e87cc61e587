"""Keeps ``proto/PROTOCOL.md`` in step with the code it specifies.

The specification is prose, so these checks look only at the parts a peer implementer relies on
and that the code defines in one place: every ``Kind`` (name and number) has its own section, every
``ErrorCode`` value is listed, each kind's field table marks as required exactly the fields
``REQUIRED_FIELDS`` makes the parser demand, and every RPC method a service registers is in the
method tables. A change to any of these in the code fails here until the document follows.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from proto.frames import MAGIC, PREFIX, REQUIRED_FIELDS, VERSION, ErrorCode, Kind

ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "proto" / "PROTOCOL.md"

KIND_HEADING = re.compile(r"^### (\d+) `([A-Z_]+)`\s*$")
TABLE_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC_PATH.read_text(encoding="utf-8")


def _section(doc: str, heading: re.Pattern[str] | str) -> list[str]:
    """Lines after the first heading matching ``heading`` up to the next heading of the same or a higher level."""
    lines = doc.splitlines()
    pat = re.compile(heading) if isinstance(heading, str) else heading
    for i, line in enumerate(lines):
        if pat.match(line):
            level = len(line) - len(line.lstrip("#"))
            out = []
            for nxt in lines[i + 1 :]:
                if nxt.startswith("#"):
                    nlevel = len(nxt) - len(nxt.lstrip("#"))
                    if nlevel <= level:
                        break
                out.append(nxt)
            return out
    raise AssertionError(f"PROTOCOL.md has no heading matching {pat.pattern!r}")


def _kind_sections(doc: str) -> dict[str, tuple[int, list[str]]]:
    """``{kind name: (number in the heading, section lines)}`` for every ``### <n> `<NAME>``` heading."""
    out = {}
    for line in doc.splitlines():
        m = KIND_HEADING.match(line)
        if m:
            number, name = int(m.group(1)), m.group(2)
            assert name not in out, f"kind {name} has two sections"
            out[name] = (number, _section(doc, re.escape(line) + "$"))
    return out


def _field_rows(lines: list[str]) -> dict[str, list[str]]:
    """Rows of the field table in a kind section: ``{field: [type, required, meaning]}``."""
    rows = {}
    for line in lines:
        m = TABLE_ROW.match(line)
        if m:
            cells = [c.strip() for c in m.group(2).split("|")]
            rows[m.group(1)] = cells
    return rows


def test_every_kind_has_a_section_with_its_number(doc):
    sections = _kind_sections(doc)
    want = {k.name: int(k) for k in Kind}
    got = {name: number for name, (number, _) in sections.items()}
    assert got == want, "kind sections (### <number> `<NAME>`) differ from proto.frames.Kind"


def test_every_kind_is_in_the_summary_table(doc):
    for k in Kind:
        row = re.compile(rf"^\|\s*{int(k)}\s*\|\s*`{k.name}`\s*\|", re.M)
        assert row.search(doc), f"summary table lacks the row | {int(k)} | `{k.name}` |"


def test_required_fields_match_each_kind_section(doc):
    sections = _kind_sections(doc)
    assert set(REQUIRED_FIELDS) == set(Kind), "REQUIRED_FIELDS should cover every kind"
    for kind, fields in REQUIRED_FIELDS.items():
        _, lines = sections[kind.name]
        rows = _field_rows(lines)
        for f in fields:
            assert f in rows, f"{kind.name} section has no table row for required field `{f}`"
            assert f"`{f}`" in "\n".join(lines)
        marked = {name for name, cells in rows.items() if len(cells) >= 2 and cells[1] == "yes"}
        assert marked == set(fields), (
            f"{kind.name}: fields marked required in PROTOCOL.md {sorted(marked)} "
            f"!= REQUIRED_FIELDS {sorted(fields)}"
        )


def test_every_error_code_is_listed(doc):
    section = "\n".join(_section(doc, r"^## 8\. Error codes"))
    listed = set(re.findall(r"^\|\s*`([a-z_]+)`\s*\|", section, re.M))
    assert listed == {c.value for c in ErrorCode}, "error code table differs from proto.frames.ErrorCode"


def test_prefix_constants(doc):
    assert f"`{PREFIX.format}`" in doc
    assert f'"{MAGIC.decode()}"' in doc
    assert f"currently {VERSION}" in doc
    assert f"{PREFIX.size}-byte" in doc


def _registered_methods() -> dict[str, set[str]]:
    """Method names passed as ``handlers``/``stream_handlers`` dict literals to ``RpcServer(...)`` in services/."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "services").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RpcServer"):
                continue
            for kw in node.keywords:
                if kw.arg in ("handlers", "stream_handlers") and isinstance(kw.value, ast.Dict):
                    for key in kw.value.keys:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            out.setdefault(path.parent.name, set()).add(key.value)
    return out


def test_every_served_method_is_in_the_method_tables(doc):
    methods = _registered_methods()
    assert methods, "found no RpcServer(...) registrations under services/"
    section = "\n".join(_section(doc, r"^## 9\. Services"))
    documented = set(re.findall(r"^\|\s*`([a-z_]+)`\s*\|", section, re.M))
    for service, names in methods.items():
        missing = names - documented
        assert not missing, f"{service} serves {sorted(missing)}, not in PROTOCOL.md section 9"
