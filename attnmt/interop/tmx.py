"""Translation memories in the files CAT tools exchange: TMX 1.4 (read and written with
translate-toolkit's TMX store, `pip install 'attnmt[tm]'`) and TSV (source TAB target, a pair
a line). What `attnmt tm import` and `attnmt tm export` read and write."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from attnmt.data.text import check_input, read_lines
from attnmt.data.tm import Segment
from attnmt.errors import AttnmtError, DataError

XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"


def _tmx() -> Any:
    try:
        from translate.storage import tmx
    except ImportError:
        raise AttnmtError(
            "TMX needs translate-toolkit: pip install torch==2.13.0 'attnmt[tm]'"
        ) from None
    return tmx


def same_language(code: str, wanted: str) -> bool:
    """'de-DE' is 'de' (and 'de' is 'de-DE'): the primary subtags compared, whatever case."""
    a, b = code.lower().replace("_", "-"), wanted.lower().replace("_", "-")
    return a == b or a.split("-")[0] == b.split("-")[0]


def read_tmx(
    path: Path, src_lang: str | None, tgt_lang: str | None
) -> tuple[list[tuple[str, str]], list[str], str, str]:
    """A TMX file's (source, target) pairs for one language pair (default: the header's
    srclang, into the one other language its units hold), each unit's attributes, props and
    notes as JSON (kept, and written back by tmx_bytes), and that pair. Units without both
    languages are skipped; inline tags come as the text CAT tools show (`<b>Hund</b>`). A file
    that declares entities is refused (entity expansion bombs, external entities)."""
    check_input(path)
    head = path.read_bytes()[: 1 << 20]
    if b"<!ENTITY" in head.split(b"<tmx", 1)[0].upper():
        raise AttnmtError(f"{path}: declares XML entities; a TMX file needs none (refused)")
    try:
        store = _tmx().tmxfile.parsefile(str(path))
    except Exception as e:  # lxml's XMLSyntaxError names the line
        raise AttnmtError(f"{path}: not a TMX file: {e}") from None
    units = [
        [(node.get(XML_LANG) or "", unit.getNodeText(node)) for node in unit.getlanguageNodes()]
        for unit in store.units
    ]
    src_lang = src_lang or store.getsourcelanguage()
    if not src_lang:
        raise AttnmtError(f"{path}: no srclang in its header: give --src-lang")
    if tgt_lang is None:
        others = {c.split("-")[0].lower() for u in units for c, _ in u}
        others -= {src_lang.split("-")[0].lower()}
        if len(others) != 1:
            raise AttnmtError(f"{path}: give --tgt-lang (it holds {', '.join(sorted(others))})")
        tgt_lang = others.pop()
    pairs, attributes = [], []
    for unit, texts in zip(store.units, units, strict=True):
        src = [t for c, t in texts if same_language(c, src_lang)]
        tgt = [t for c, t in texts if same_language(c, tgt_lang)]
        if src and tgt and src[0].strip() and tgt[0].strip():
            pairs.append((src[0], tgt[0]))
            attributes.append(_kept(unit.xmlelement))
    if not pairs and units:
        raise AttnmtError(f"{path}: no unit holds both {src_lang} and {tgt_lang}")
    return pairs, attributes, src_lang.split("-")[0].lower(), tgt_lang.split("-")[0].lower()


def _kept(tu: Any) -> str:
    """A <tu>'s attributes, <prop>s and <note>s as JSON."""
    props = [[p.get("type", ""), p.text or ""] for p in tu if _local(p.tag) == "prop"]
    notes = [n.text or "" for n in tu if _local(n.tag) == "note"]
    return json.dumps({"tu": dict(tu.attrib), "props": props, "notes": notes},
                      ensure_ascii=False, sort_keys=True)  # fmt: skip


def _local(tag: object) -> str:
    return str(tag).rsplit("}", 1)[-1]


def read_tsv(path: Path) -> list[tuple[str, str]]:
    """source TAB target, a pair a line (blank lines skipped); a line without exactly one
    tab is an error naming file:line."""
    check_input(path)
    pairs = []
    for n, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise DataError(f"{path}:{n}: expected source TAB target, got {line[:80]!r}")
        pairs.append((parts[0], parts[1]))
    return pairs


def tmx_bytes(segments: Iterable[Segment], src_lang: str, tgt_lang: str) -> bytes:
    """The segments as a TMX 1.4 document: each unit with the attributes, props and notes
    it was imported with (else its origin as a note)."""
    from lxml import etree

    store = _tmx().tmxfile(sourcelanguage=src_lang, targetlanguage=tgt_lang)
    for segment in segments:
        unit = store.addsourceunit(segment.source)
        unit.target = segment.target
        kept = json.loads(segment.attributes or "{}")
        tu = unit.xmlelement
        for key, value in kept.get("tu", {}).items():
            tu.set(key, value)
        for i, (kind, text) in enumerate(kept.get("props", [])):
            prop = etree.Element("prop", type=kind)
            prop.text = text
            tu.insert(i, prop)
        for note in kept.get("notes") or [segment.origin]:
            unit.addnote(note)
    return bytes(store)


def tsv_bytes(segments: Iterable[Segment]) -> bytes:
    return "".join(f"{s.source}\t{s.target}\n" for s in segments).encode("utf-8")
