"""Tag-preserving translation: lines with inline XML/HTML tags (`<b>`, `<a href="…">`, `<x
id="1"/>` placeholders) are translated without their tags, and each tag is put back around the
output words aligned to the source words it surrounded (attnmt.decoding.alignment).

A line's tags form a tree over its words (an element spans the words between its opening and
closing tags; a self-closing tag sits before a word). Placed in the output, an element covers
the output words aligned to any of its words (their longest run of consecutive words), cut to
its parent's span and kept clear of the siblings placed before it; siblings are placed in the
order of their output words, so a reordering model reorders them. A source word no output word
chose takes the output word that attends to it most. A self-closing tag (or an element empty
in the source) goes before the output word aligned to the word after it. The
output's tags are therefore always balanced and properly nested, whatever the model does, and
an element that held words in the source holds at least one in the output: one whose words
all went to the sibling before it wraps that sibling, one with no aligned word takes the word
at its place. A
closing tag with no opening tag is dropped; an opening tag never closed spans to the line's
end. Entities are decoded for translation and the output text is escaped (&, <, >) again.
A comment (`<!-- … -->`, or one never closed: to the line's end) and a CDATA section are kept
as they are, as a self-closing tag is: what they hold is never read as tags nor translated.
Tags nested deeper than MAX_DEPTH are refused (a line is text, not a document).
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from attnmt.decoding.alignment import word_weights
from attnmt.decoding.translation import Translation
from attnmt.errors import AttnmtError

MAX_DEPTH = 64  # tags open at once in a line
TAIL = re.compile(r"[.,!?:;…]+$")  # punctuation ending a word
ENTITY_END = re.compile(r"&(?:#\d+|#x[0-9a-fA-F]+|\w+);$")
# What stays as it is: a comment (closed, or to the line's end) or a CDATA section.
OPAQUE = re.compile(r"<!--.*?(?:-->|$)|<!\[CDATA\[.*?(?:\]\]>|$)", re.DOTALL)

# A tag: <name attr="…" …>, </name> or <name …/>; a quoted attribute value may hold < and >.
TAG = re.compile(
    r"<(/?)([A-Za-z_][\w:.-]*)((?:\s+[^\s=/>\"']+(?:\s*=\s*(?:\"[^\"]*\"|'[^']*'|[^\s>\"']+))?)*)"
    r"\s*(/?)>"
)


@dataclass
class Element:
    """A tag pair (or a self-closing tag: `close` empty) over source words [start, end)."""

    open: str
    close: str
    start: int
    end: int = -1
    children: list[Element] = field(default_factory=list)
    punct_inside: bool = True  # its last source word ends in punctuation (a tail may stay in)

    def whole(self) -> str:
        """The element with nothing inside but its children's tags (an empty span)."""
        return self.open + "".join(c.whole() for c in self.children) + self.close


def parse(line: str) -> tuple[str, Element]:
    """The line's text (entities decoded, tags removed) and the tree of its tags."""
    root = Element("", "", 0)
    stack, words, text, last_word = [root], 0, [], ""
    at = 0
    for m in [*_tags(line), None]:
        chunk = html.unescape(line[at : m.start() if m else len(line)])
        text.append(chunk)
        words += len(chunk.split())  # each chunk starts a word: a tag ends the one before
        last_word = chunk.split()[-1] if chunk.split() else last_word
        if m is None:
            break
        at = m.end()
        opaque = m.re is OPAQUE
        closing, name, self_closing = ("", "", "x") if opaque else m.group(1, 2, 4)
        text.append(" ")  # a tag ends the word before it: "a<b>big" is "a" then "big"
        if self_closing:
            stack[-1].children.append(Element(m.group(0), "", words, words))
        elif not closing:
            if len(stack) > MAX_DEPTH:
                raise AttnmtError(f"markup: tags nested more than {MAX_DEPTH} deep")
            stack.append(Element(m.group(0), "", words))
            stack[-2].children.append(stack[-1])
        elif any(_name(e.open) == name for e in stack[1:]):
            while True:  # elements left open inside it close with it
                e = stack.pop()
                e.end = words
                e.punct_inside = _tail(last_word) != ""
                e.close = m.group(0) if _name(e.open) == name else f"</{_name(e.open)}>"
                if _name(e.open) == name:
                    break
    for e in stack[1:]:  # never closed: to the line's end
        e.end, e.close = words, f"</{_name(e.open)}>"
    return " ".join("".join(text).split()), root


def _tail(word: str) -> str:
    """The punctuation a word ends in ("." of "wallet."), none if it is the whole word or an
    entity's `;` (`&amp;`)."""
    m = TAIL.search(word)
    if m is None or m.start() == 0 or ENTITY_END.search(word[: m.end()]):
        return ""
    return m.group(0)


def _tags(line: str) -> list[re.Match[str]]:
    """The line's tags, comments and CDATA sections in order; nothing inside a comment or a
    CDATA section is a tag."""
    found: list[re.Match[str]] = []
    at, opaque = 0, OPAQUE.search(line)
    for tag in TAG.finditer(line):
        if tag.start() < at:
            continue  # inside a comment taken already
        while opaque is not None and opaque.start() < tag.start():
            if opaque.start() >= at:
                found.append(opaque)
                at = opaque.end()
            opaque = OPAQUE.search(line, max(at, opaque.start() + 1))
        if tag.start() >= at:
            found.append(tag)
            at = tag.end()
    while opaque is not None:  # comments after the last tag
        if opaque.start() >= at:
            found.append(opaque)
            at = opaque.end()
        opaque = OPAQUE.search(line, max(at, opaque.start() + 1)) if at < len(line) else None
    return found


def _name(tag: str) -> str:
    m = TAG.fullmatch(tag)
    return m.group(2) if m else ""


def restore(
    root: Element, target: str, pairs: list[tuple[int, int]], backup: dict[int, int] | None = None
) -> str:
    """`target` (plain text) with the tags of `root` put back by `pairs` (source word,
    target word); `backup`: for a source word no pair names, the output word to use (the one
    that attends to it most). See the module's docstring."""
    words = [html.escape(w, quote=False) for w in target.split()]
    to_target: dict[int, list[int]] = {}
    for i, j in pairs:
        to_target.setdefault(i, []).append(j)
    for i, j in (backup or {}).items():
        to_target.setdefault(i, [j])
    tokens = _place(root, 0, len(words), words, to_target)
    return _join(tokens)


def _span(e: Element, to_target: dict[int, list[int]]) -> tuple[int, int] | None:
    """The longest run of consecutive output words aligned to the element's words (the
    first of equals), [first, last + 1): a word aligned far away does not stretch the
    element over the words between. None: no word is aligned."""
    js = sorted({j for i in range(e.start, e.end) for j in to_target.get(i, [])})
    if not js:
        return None
    runs, first = [], js[0]
    for a, b in zip(js, [*js[1:], None], strict=True):
        if b != a + 1:
            runs.append((first, a + 1))
            first = b
    return max(runs, key=lambda r: r[1] - r[0])


def _anchor(e: Element, to_target: dict[int, list[int]]) -> int | None:
    """Where an element with no aligned word goes: before the first output word aligned to a
    source word at or after its start (None: the end)."""
    later = [j for i, js in to_target.items() if i >= e.start for j in js]
    return min(later) if later else None


def _place(
    node: Element, lo: int, hi: int, words: list[str], to_target: dict[int, list[int]]
) -> list[tuple[str, str]]:
    """Tokens (kind, text) of output words lo..hi with node's children's tags placed among
    them; kinds: word, open, close, whole (an element placed with nothing inside: only one
    that had nothing inside in the source, or a self-closing tag)."""
    placed = []  # (start, end, child): start == end places it whole, nothing inside
    for c in node.children:
        had_words = bool(c.close) and c.end > c.start
        span = _span(c, to_target) if had_words else None
        if span is None:  # no aligned word: at its first word's place (a word, if it had)
            at = _anchor(c, to_target)
            at = hi if at is None else at
            span = (at, at + 1) if had_words else (at, at)
        first, last = (min(max(x, lo), hi) for x in span)
        if had_words and lo < hi:  # at least a word of its parent's
            first = min(first, hi - 1)
            last = max(last, first + 1)
        placed.append((first, last, c))
    placed.sort(key=lambda p: (p[0], p[1] > p[0]))  # in output order; empty ones first
    tokens: list[tuple[str, str]] = []
    j = lo
    previous: tuple[int, int] | None = None  # the last sibling placed: its open, close index
    for first, last, c in placed:
        first = max(first, j)  # clear of the siblings placed before it
        last = max(last, first)
        tokens += [("word", w) for w in words[j:first]]
        j = first
        if last == first and c.close and c.end > c.start:
            if previous is not None and previous[1] == _last_close(tokens):
                # Its words went to the sibling before it: it wraps that sibling (both tags
                # around the words both were aligned to), never left empty.
                opened, closed = previous
                tokens.insert(opened, ("open", c.open))
                tokens.insert(closed + 2, ("close", c.close))
                previous = (opened, closed + 2)
                continue
            last = min(first + 1, hi)  # else the next word, if there is one
        if last == first:
            tokens.append(("whole", c.whole()))
            continue
        inner = _place(c, first, last, words, to_target)
        tail: list[tuple[str, str]] = []
        if not c.punct_inside and inner and inner[-1][0] == "tail":
            tail = [inner.pop()]  # a child's punctuation, put out of it: out of this one too
        elif not c.punct_inside and inner and inner[-1][0] == "word" and _tail(inner[-1][1]):
            word = inner[-1][1]  # punctuation outside the tag in the source stays outside
            inner[-1] = ("word", word[: len(word) - len(_tail(word))])
            tail = [("tail", _tail(word))]
        previous = (len(tokens), len(tokens) + len(inner) + 1)
        tokens += [("open", c.open), *inner, ("close", c.close), *tail]
        j = last
    return tokens + [("word", w) for w in words[j:hi]]


def _last_close(tokens: list[tuple[str, str]]) -> int:
    """The index of the last closing tag in tokens (before any tail after it), -1 if none."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i][0] == "close":
            return i
        if tokens[i][0] != "tail":
            return -1
    return -1


def _join(tokens: list[tuple[str, str]]) -> str:
    """Words separated by single spaces; an opening tag (or a whole element) joins the word
    after it, a closing tag the word before it."""
    out, pending, any_word = [], "", False
    for kind, text in tokens:
        if kind == "word":
            out.append((" " if any_word else "") + pending + text)
            pending, any_word = "", True
        elif kind in ("close", "tail"):
            out.append(pending + text)
            pending = ""
        else:
            pending += text
    out.append(pending)
    return "".join(out)


def put_back(found: list[list[Translation]], trees: Sequence[Element]) -> None:
    """In place: each hypothesis's text with its line's tags restored by its alignment (and,
    for a source word no output word chose, the output word that attends to it most)."""
    for results, tree in zip(found, trees, strict=True):
        for r in results:
            if r.attention is None:  # an empty line
                r.text = restore(tree, r.text, [])
                continue
            weights = word_weights(r.src_pieces, r.tgt_pieces, r.attention)  # (T, S)
            pairs = (
                [(int(i), j) for j, i in enumerate(weights.argmax(1).tolist())]
                if weights.numel()
                else []
            )
            backup = dict(enumerate(weights.argmax(0).tolist())) if weights.numel() else {}
            r.text = restore(tree, r.text, pairs, backup)
