"""One vocabulary (docs/design.md §16): the glossary's words mean one thing in file, class and function names
of schemas/, services/ and learner/, as they do in the docs.

* Words tied to one side: `shard` is a syncer process (an island's part of a tensor is a *piece*, a trainer's
  data is its data), `piece` a rank's part of a synced tensor (the syncer holds fragments), `anchor` what an
  island last installed, `lease`, `standby`, `coordinator` and `intent` the syncer's. A name is split into its
  words (snake_case, CamelCase), so `release` is not `lease`.
* A class named with one glossary word alone (`Cut`, `Piece`, `Round`) claims to *be* that thing: each is
  listed here with the module that holds it, so a new one is looked at before it lands.
Read from the source with `ast`: no imports, no torch.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "services", "learner")

# word -> (its one meaning, the path prefixes whose names may use it)
ONE_SIDE = {
    "shard": ("a syncer process owning the fragments f mod N == K (§10)", ("schemas/", "services/")),
    "piece": ("a rank's part of one synced tensor (§6)", ("learner/",)),
    "anchor": ("the raw Θ of the version an island last installed", ("learner/",)),
    "lease": ("the state key naming a run's owning syncer (§11)", ("services/syncer/",)),
    "standby": ("a syncer waiting to take over a run (§11)", ("services/",)),
    "coordinator": ("syncer shard 0 (§10)", ("services/",)),
    "intent": ("the durable record of a merge's inputs (§8)", ("services/syncer/",)),
}
# Another project's own word, kept where our code speaks to it: megatron-core's distributed optimizer
# calls its per-rank ranges "shards" (`shard_fp32_groups`), and the adapter names its helper after them.
FOREIGN = {("learner/adapters/megatron.py", "shard")}

# Classes named with one glossary word alone, and the module each lives in: the thing itself.
BARE = {
    ("piece", "learner/adapters/base.py"),    # this rank's piece of one synced tensor
    ("round", "services/syncer/state.py"),    # one round's state in the syncer's machine
    ("mode", "learner/island_modes.py"),      # the island's staging strategy and push sender
    ("boundary", "learner/boundary.py"),      # the island's boundary machine
    ("message", "schemas/messages.py"),       # the base of the typed wire messages
}
# Misnamed, to be renamed: the syncer's `Cut` holds the merged model and publishes versions, while a cut is
# the set of every fragment's current version. The lead shrinks this set (services/syncer/ is being
# restructured in parallel); the test fails once an entry no longer exists, so it cannot go stale.
PENDING_RENAMES: dict[tuple[str, str], str] = {}


def glossary_words() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text().split("## 16. Glossary", 1)[1]
    return {w.lower() for w in re.findall(r"^\* \*\*([A-Za-z]+)\*\*", text, re.M)}


def words(name: str) -> list[str]:
    """The words of an identifier, lower case: `CutReader` -> [cut, reader], `_gather_sharded` -> [gather,
    sharded]."""
    parts = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return [p.lower() for p in parts]


def stem(word: str) -> str:
    """The ONE_SIDE word `word` is a form of (shards, sharded, sharding -> shard), else `word`."""
    for w in ONE_SIDE:
        if word in {w, w + "s", w + "d", w + "ed", w + "ing"}:
            return w
    return word


def names(path: Path) -> list[tuple[str, str]]:
    """(kind, name) of the module itself, its classes and its functions."""
    out = [("file", path.stem)]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            out.append(("class", node.name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(("def", node.name))
    return out


def modules() -> list[tuple[str, Path]]:
    return sorted((str(p.relative_to(ROOT)), p) for d in PACKAGES for p in (ROOT / d).rglob("*.py"))


def one_side_violations(rel: str, found: list[tuple[str, str]]) -> list[str]:
    bad = []
    for kind, name in found:
        for w in {stem(x) for x in words(name)} & ONE_SIDE.keys():
            meaning, where = ONE_SIDE[w]
            if not rel.startswith(where) and (rel, w) not in FOREIGN:
                bad.append(f"{rel}: {kind} {name}: {w!r} means {meaning}")
    return bad


def test_words_split_and_stem():
    assert words("CutReader") == ["cut", "reader"] and words("_gather_sharded") == ["gather", "sharded"]
    assert words("PublishShardFinal") == ["publish", "shard", "final"] and words("HTTPServer") == ["http", "server"]
    assert [stem(w) for w in ("sharded", "sharding", "shards", "pieces", "release", "anchors", "leases")] == \
        ["shard", "shard", "shard", "piece", "release", "anchor", "lease"]


def test_the_check_finds_a_word_on_the_wrong_side():
    assert one_side_violations("learner/x.py", [("class", "ShardBox"), ("def", "gather_shards")]) == [
        "learner/x.py: class ShardBox: 'shard' means " + ONE_SIDE["shard"][0],
        "learner/x.py: def gather_shards: 'shard' means " + ONE_SIDE["shard"][0]]
    assert one_side_violations("services/syncer/x.py", [("file", "piece_store")])
    assert not one_side_violations("learner/x.py", [("def", "release"), ("class", "PieceReads")])


def test_one_side_words_stay_on_their_side():
    mods = modules()
    assert len(mods) > 100 and any(r == "learner/adapters/base.py" for r, _ in mods)   # the walk found the code
    bad = [b for rel, p in mods for b in one_side_violations(rel, names(p))]
    assert not bad, "a glossary word used for another thing (docs/design.md §16):\n" + "\n".join(bad)


def test_a_class_named_by_one_glossary_word_is_that_thing():
    vocab = glossary_words()
    assert {"cut", "shard", "piece", "fragment", "anchor"} <= vocab, vocab
    for word, _ in BARE | PENDING_RENAMES.keys():
        assert word in vocab, f"{word!r} is not a glossary word"
    seen = {(n.lower(), rel) for rel, p in modules() for kind, n in names(p) if kind == "class" and n.lower() in vocab}
    unlisted = sorted(seen - BARE - PENDING_RENAMES.keys())
    assert not unlisted, ("classes named by one glossary word: make them that thing and list them in BARE, or "
                          f"name them for what they hold: {unlisted}")
    renamed = sorted(set(PENDING_RENAMES) - seen)
    assert not renamed, f"renamed already: drop them from PENDING_RENAMES: {renamed}"


def test_shard_in_a_test_file_name_means_a_syncer_shard():
    """A test of an island's pieces says piece; `shard` in a test's file name is a syncer shard's."""
    tests = sorted(p.name for p in (ROOT / "tests").glob("test_*shard*.py"))
    assert tests and all("island" not in n and "piece" not in n for n in tests), tests
