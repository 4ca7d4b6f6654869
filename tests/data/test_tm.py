"""Translation memories (issue 80): the SQLite store (transactions, concurrent readers,
nothing committed lost to kill -9), fuzzy scores as CAT tools define them, retrieval through
the index, TMX and TSV in and out, and `attnmt tm`'s commands."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnmt.data.fuzzy import best_matches, fuzzy_score
from attnmt.data.tm import TranslationMemory
from attnmt.errors import AttnmtError, DataError

from helpers import assert_user_error

PAIRS = [
    ("Ein Hund läuft über die Wiese.", "A dog runs across the meadow."),
    ("Eine Katze schläft auf dem Sofa.", "A cat sleeps on the sofa."),
    ("Zwei Kinder spielen im Park.", "Two children play in the park."),
    ("Der Mann liest eine Zeitung.", "The man reads a newspaper."),
]


def test_fuzzy_score_is_one_minus_word_edits_over_words():
    assert fuzzy_score("Ein Hund läuft.", "Ein Hund läuft.") == 1.0
    # one word of four units (three words and the full stop) replaced: 75 %
    assert fuzzy_score("Ein Hund läuft.", "Ein Hund schläft.") == pytest.approx(0.75)
    assert fuzzy_score("Ein Hund läuft.", "ein Hund läuft.") == pytest.approx(0.75)  # case counts
    assert fuzzy_score("a b c d", "x y") == pytest.approx(0.0)


def test_import_is_one_transaction_and_adds_nothing_twice(tmp_path: Path):
    with TranslationMemory(tmp_path / "tm.db", create=True) as tm:
        assert tm.add_many(PAIRS, "de", "en", "a.tsv") == 4
        assert tm.add_many(PAIRS, "de", "en", "a.tsv") == 0  # the same pairs: nothing new
        with pytest.raises(DataError, match="both sides"):
            tm.add_many([("Neu.", "New."), ("Leer.", " ")], "de", "en", "b.tsv")
        assert tm.stats()["segments"] == 4  # the bad file added nothing, not even its first
        assert tm.pairs() == {("de", "en"): 4}


def test_best_matches_finds_near_repeats_and_the_exact_one_first(tmp_path: Path):
    with TranslationMemory(tmp_path / "tm.db", create=True) as tm:
        tm.add_many(PAIRS, "de", "en", "a")
        tm.add_many([(PAIRS[0][0], "A dog is running over the meadow.")], "de", "en", "b")
        found = best_matches(tm, "Ein Hund läuft über die Wiese.", ("de", "en"), k=3)
        assert found[0].score == 1.0 and found[0].segment.origin == "b"  # the newest exact
        near = best_matches(tm, "Ein Hund rennt über die Wiese.", ("de", "en"))
        assert near[0].segment.source == PAIRS[0][0]
        assert near[0].score == pytest.approx(1 - 1 / 7)
        assert best_matches(tm, "Völlig anders.", ("de", "en")) == []
        assert best_matches(tm, PAIRS[0][0], ("de", "fr")) == []  # another pair


def test_a_reader_reads_while_a_writer_writes(tmp_path: Path):
    path = tmp_path / "tm.db"
    with TranslationMemory(path, create=True) as tm:
        tm.add_many(PAIRS, "de", "en", "a")
    seen, stop = [], threading.Event()

    def read() -> None:
        with TranslationMemory(path) as reader:
            while not stop.is_set():
                seen.append(len(best_matches(reader, PAIRS[1][0], ("de", "en"))))

    thread = threading.Thread(target=read)
    thread.start()
    with TranslationMemory(path) as writer:
        for i in range(50):
            writer.add(f"Satz {i}.", f"Sentence {i}.", "de", "en", "post-edit")
    stop.set()
    thread.join()
    assert seen and all(n == 1 for n in seen)


def test_kill_9_loses_no_committed_segment(tmp_path: Path):
    """A process adding post-edits one by one, killed mid-way: every segment it reported
    stored is there, the file is a sound database, and it opens again."""
    path = tmp_path / "tm.db"
    script = (
        "import sys\nfrom attnmt.data.tm import TranslationMemory\n"
        f"tm = TranslationMemory({str(path)!r}, create=True)\n"
        "for i in range(100000):\n"
        "    tm.add(f'Satz {i}.', f'Sentence {i}.', 'de', 'en', 'x')\n"
        "    print(i, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    reported = -1
    deadline = time.monotonic() + 60
    while reported < 30 and time.monotonic() < deadline:
        reported = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with TranslationMemory(path) as tm:
        assert tm.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        stored = {s.source for s in tm.segments()}
    assert {f"Satz {i}." for i in range(reported + 1)} <= stored


def test_a_file_that_is_no_tm_is_one_clear_error(tmp_path: Path):
    bad = tmp_path / "bad.db"
    bad.write_text("not sqlite")
    with pytest.raises(AttnmtError, match="not a translation memory"):
        TranslationMemory(bad)
    with pytest.raises(AttnmtError, match="no translation memory there"):
        TranslationMemory(tmp_path / "missing.db")
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("PRAGMA user_version=7")
    with pytest.raises(AttnmtError, match="schema 7"):
        TranslationMemory(other)


def tmx_text() -> str:
    units = "".join(
        f'<tu><tuv xml:lang="de-DE"><seg>{s}</seg></tuv><tuv xml:lang="en-GB"><seg>{t}</seg>'
        f'</tuv><tuv xml:lang="fr"><seg>x</seg></tuv></tu>'
        for s, t in PAIRS
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?><tmx version="1.4"><header srclang="de-DE" '
        'adminlang="en" datatype="plaintext" segtype="sentence" o-tmf="x" creationtool="x" '
        f'creationtoolversion="1"/><body>{units}</body></tmx>'
    )


def test_tm_commands_import_tmx_and_tsv_export_and_match(tmp_path: Path, run_cli):
    pytest.importorskip("translate.storage.tmx")
    tmx, db = tmp_path / "mem.tmx", tmp_path / "tm.db"
    tmx.write_text(tmx_text(), encoding="utf-8")
    result = run_cli("tm", "import", str(tmx), "--db", str(db), "--tgt-lang", "en")
    assert result.code == 0, result.stderr
    assert "4 new segments de-en of 4" in result.stdout
    tsv = tmp_path / "more.tsv"
    tsv.write_text("Ein Vogel singt.\tA bird sings.\n", encoding="utf-8")
    assert run_cli("tm", "import", str(tsv), "--db", str(db), "--src-lang", "de",
                   "--tgt-lang", "en").code == 0  # fmt: skip
    stats = json.loads(run_cli("tm", "stats", "--db", str(db), "--json").stdout)
    assert stats["segments"] == 5 and stats["origins"] == {"mem.tmx": 4, "more.tsv": 1}
    out = tmp_path / "out.tmx"
    assert run_cli("tm", "export", str(out), "--db", str(db)).code == 0
    again = tmp_path / "again.db"
    assert run_cli("tm", "import", str(out), "--db", str(again)).code == 0  # a round trip
    with TranslationMemory(db) as a, TranslationMemory(again) as b:
        assert [(s.source, s.target) for s in a.segments()] == [
            (s.source, s.target) for s in b.segments()
        ]
    found = run_cli("tm", "match", "--db", str(db), stdin=b"Ein Vogel singt laut.\n")
    best = json.loads(found.stdout.splitlines()[0])[0]
    assert best["target"] == "A bird sings." and best["score"] == pytest.approx(0.8)
    added = run_cli("tm", "add", "--db", str(db), "--source", "Hallo.", "--target", "Hello.",
                    "--pair", "de-en")  # fmt: skip
    assert added.code == 0 and "segment 6" in added.stdout


def test_tm_commands_refuse_bad_input_in_one_line(tmp_path: Path, run_cli):
    db = tmp_path / "tm.db"
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("eins\tone\nzwei ohne Tab\n", encoding="utf-8")
    assert_user_error(
        run_cli("tm", "import", str(tsv), "--db", str(db), "--src-lang", "de", "--tgt-lang", "en"),
        f"{tsv}:2",
    )
    assert_user_error(run_cli("tm", "import", str(tsv), "--db", str(db)), "--src-lang")
    broken = tmp_path / "broken.tmx"
    broken.write_text("<tmx><body><tu>", encoding="utf-8")
    assert_user_error(run_cli("tm", "import", str(broken), "--db", str(db)), "not a TMX file")
    assert_user_error(run_cli("tm", "stats", "--db", str(tmp_path / "none.db")), "no translation")


OTHER_TOOL_TMX = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE tmx SYSTEM "tmx14.dtd">
<tmx version="1.4">
<header creationtool="SomeCAT" creationtoolversion="9" datatype="plaintext" segtype="sentence"
 adminlang="en-US" srclang="de-DE" o-tmf="SomeCAT TM"/>
<body>
<tu tuid="17" creationdate="20240102T101500Z" creationid="anna" usagecount="3">
<prop type="x-project">Handbuch</prop>
<note>approved</note>
<tuv xml:lang="de-DE"><seg>Der Drucker ist bereit.</seg></tuv>
<tuv xml:lang="en-US"><seg>The printer is ready.</seg></tuv>
</tu>
<tu tuid="18" creationdate="20240103T090000Z">
<tuv xml:lang="de-DE"><seg>Papier einlegen.</seg></tuv>
<tuv xml:lang="en-US"><seg>Load paper.</seg></tuv>
</tu>
</body>
</tmx>
"""


def test_a_tmx_of_another_tool_round_trips_with_its_attributes(tmp_path: Path, run_cli):
    pytest.importorskip("translate.storage.tmx")
    from lxml import etree

    given, db, out = tmp_path / "cat.tmx", tmp_path / "tm.db", tmp_path / "out.tmx"
    given.write_text(OTHER_TOOL_TMX, encoding="utf-8")
    assert run_cli("tm", "import", str(given), "--db", str(db)).code == 0
    assert run_cli("tm", "export", str(out), "--db", str(db)).code == 0
    tus = etree.parse(str(out)).getroot().iter("tu")
    first = next(tus)
    assert first.get("tuid") == "17" and first.get("creationid") == "anna"
    assert first.get("usagecount") == "3" and first.get("creationdate") == "20240102T101500Z"
    assert [(p.get("type"), p.text) for p in first.iter("prop")] == [("x-project", "Handbuch")]
    assert [n.text for n in first.iter("note")] == ["approved"]
    assert next(tus).get("tuid") == "18"
    with TranslationMemory(db) as tm:
        found = [(s.source, s.target) for s in tm.segments()]
    assert found == [("Der Drucker ist bereit.", "The printer is ready."),
                     ("Papier einlegen.", "Load paper.")]  # fmt: skip


BOMB = """<?xml version="1.0"?>
<!DOCTYPE tmx [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">
<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>
<tmx version="1.4"><header srclang="de"/><body><tu><tuv xml:lang="de"><seg>&d;</seg></tuv>
<tuv xml:lang="en"><seg>x</seg></tuv></tu></body></tmx>
"""
XXE = """<?xml version="1.0"?>
<!DOCTYPE tmx [<!ENTITY secret SYSTEM "file:///etc/hostname">]>
<tmx version="1.4"><header srclang="de"/><body><tu><tuv xml:lang="de"><seg>&secret;</seg>
</tuv><tuv xml:lang="en"><seg>x</seg></tuv></tu></body></tmx>
"""


@pytest.mark.parametrize("text", [BOMB, XXE], ids=["entity bomb", "external entity"])
def test_a_tmx_declaring_entities_is_refused_and_nothing_written(tmp_path, run_cli, text):
    pytest.importorskip("translate.storage.tmx")
    given, db = tmp_path / "evil.tmx", tmp_path / "tm.db"
    given.write_text(text, encoding="utf-8")
    assert_user_error(run_cli("tm", "import", str(given), "--db", str(db)), "entities")
    assert not db.exists()


def test_a_tm_of_another_language_pair_is_one_line_and_nothing_written(tmp_path, run_cli):
    pytest.importorskip("translate.storage.tmx")
    given, db = tmp_path / "cat.tmx", tmp_path / "tm.db"
    given.write_text(OTHER_TOOL_TMX, encoding="utf-8")
    wrong = ("--src-lang", "fr", "--tgt-lang", "en")
    result = run_cli("tm", "import", str(given), "--db", str(db), *wrong)
    assert_user_error(result, "no unit holds both fr and en")
    assert not db.exists()


def test_kill_9_during_an_import_leaves_all_or_nothing(tmp_path: Path):
    tsv, db = tmp_path / "big.tsv", tmp_path / "tm.db"
    tsv.write_text("".join(f"Satz {i} ist hier.\tSentence {i} is here.\n" for i in range(200_000)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "tm", "import", str(tsv), "--db", str(db),
         "--src-lang", "de", "--tgt-lang", "en"], stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (db.parent / "tm.db-wal").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # inside its one transaction
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with TranslationMemory(db) as tm:
        assert tm.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert tm.stats()["segments"] in (0, 200_000)
