"""Training text for the demo model from Debian-packaged documentation (issue 18).

Sources (install with `apt-get install -y --no-install-recommends python3.11-doc
debian-reference-en`; not a CI dependency):
  /usr/share/doc/python3.11/html/_sources/**/*.rst.txt   the Python 3.11 documentation sources
  /usr/share/debian-reference/debian-reference.en.txt.gz the Debian Reference

Each document is cut into sections (a heading and its prose paragraphs; code blocks, tables and
directives dropped, reST inline markup reduced to its text). A section becomes one chat sample
in the V4.1 chat format the server renders (tokenizer/chat_format.cc, chat mode):

  <｜begin▁of▁sentence｜><｜User｜>{question about the heading}<｜Assistant｜></think>{prose}<｜end▁of▁sentence｜>

Sections are shuffled with the seed and split: every 50th section goes to the held-out set.
Writes OUT/train.txt, OUT/heldout.txt (chat samples, one after another), OUT/heldout_plain.txt
(the held-out prose alone, for `epd eval`), OUT/tokenizer_corpus.txt (the first ~3 MB of
training prose, for the BPE trainer) and OUT/words.txt (the 5000 most frequent words of the
training text, lowercase: the dictionary of the demo test). Same inputs + seed -> byte-identical files.
"""

import argparse
import glob
import gzip
import os
import random
import re

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK_END = "<｜User｜>", "<｜Assistant｜>", "</think>"

PY_SOURCES = "/usr/share/doc/python3.11/html/_sources"
DEBREF = "/usr/share/debian-reference/debian-reference.en.txt.gz"

QUESTIONS = [
    "{t}",
    "Tell me about {l}.",
    "What is {l}?",
    "Explain {l}.",
    "How does {l} work?",
    "Can you describe {l}?",
]

_ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LIT = re.compile(r"``([^`]*)``")
_REF = re.compile(r"`([^`<]*?)(?:\s*<[^>]*>)?`_*")
_EMPH = re.compile(r"\*\*?([^*]+)\*\*?")
_DESC = re.compile(r"^\.\. (function|method|class|exception|attribute|data|module|"
                   r"classmethod|staticmethod|decorator|opcode|envvar|cmdoption)::\s*([\w.]+)")
_HEADING_LINE = re.compile(r"^([=\-~^\"'`#*+<>_.:])\1{3,}\s*$")


def clean_inline(s):
    s = _ROLE.sub(r"\1", s)
    s = _LIT.sub(r"\1", s)
    s = _REF.sub(r"\1", s)
    s = _EMPH.sub(r"\1", s)
    s = s.replace("\\", "")
    return re.sub(r"\s+", " ", s).strip()


def is_prose(p):
    if len(p) < 60 or len(p.split()) < 10:
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in p)
    if letters < 0.85 * len(p):
        return False
    return not p.startswith((">>>", "$", "#", "|", "+-", "..", "*", "-", "(", "[", "{"))


def rst_sections(text):
    """-> [(heading, [paragraph, ...])] from a reST source."""
    lines = text.split("\n")
    sections, heading, paras, cur = [], None, [], []
    skip_indent = None  # inside a directive / literal block: skip lines indented deeper
    in_desc = False

    def flush_para():
        if cur:
            p = clean_inline(" ".join(cur))
            if is_prose(p):
                paras.append(p)
            cur.clear()

    i = 0
    while i < len(lines):
        ln = lines[i]
        stripped = ln.strip()
        indent = len(ln) - len(ln.lstrip())
        if skip_indent is not None:
            if stripped == "" or indent > skip_indent:
                i += 1
                continue
            skip_indent = None
        if i + 1 < len(lines) and stripped and _HEADING_LINE.match(lines[i + 1].strip()) \
                and not _HEADING_LINE.match(stripped):
            flush_para()
            if heading and paras:
                sections.append((heading, list(paras)))
            heading, paras = clean_inline(stripped), []
            i += 2
            continue
        if _HEADING_LINE.match(stripped):
            flush_para()
            i += 1
            continue
        m = _DESC.match(stripped)
        if m:  # an API description: its indented body is a section named after the object
            flush_para()
            if heading and paras:
                sections.append((heading, list(paras)))
            heading, paras = m.group(2).split(".")[-1], []
            in_desc = True
            i += 1
            continue
        if stripped.startswith(".. ") or stripped.endswith("::"):
            if stripped.endswith("::") and not stripped.startswith(".."):
                cur.append(stripped[:-1])
            flush_para()
            skip_indent = indent
            i += 1
            continue
        if stripped == "":
            flush_para()
        elif indent > 0 and not cur and not in_desc:
            pass  # an indented block (quote, definition body) with no lead-in: skip
        else:
            cur.append(stripped)
        i += 1
    flush_para()
    if heading and paras:
        sections.append((heading, paras))
    return sections


def debref_sections(text):
    """The Debian Reference text export: numbered headings ("1.2.3. Title")."""
    sections, heading, paras, cur = [], None, [], []
    head = re.compile(r"^\s*(\d+(\.\d+)*)\.\s+(\S.*)$")

    def flush():
        if cur:
            p = clean_inline(" ".join(cur))
            if is_prose(p):
                paras.append(p)
            cur.clear()

    for ln in text.split("\n"):
        m = head.match(ln)
        if m and len(ln) < 90:
            flush()
            if heading and paras:
                sections.append((heading, list(paras)))
            heading, paras = m.group(3).strip(), []
            continue
        if ln.strip() == "":
            flush()
        else:
            cur.append(ln.strip())
    flush()
    if heading and paras:
        sections.append((heading, paras))
    return sections


def usable_heading(h):
    if not (3 <= len(h) <= 60) or not re.search(r"[A-Za-z]{3}", h):
        return False
    return not re.search(r"[(){}\[\]=]|^\W", h)


def samples(heading, paras, rng, max_words=180):
    """A section's paragraphs in chunks of <= max_words (a paragraph is never split), each with
    its own question about the heading: (question, answer, topic) with topic the heading as the
    question spells it."""
    low = heading[0].lower() + heading[1:] if not heading[:2].isupper() else heading
    chunks, words, cur = [], 0, []
    for p in paras:
        if cur and words + len(p.split()) > max_words:
            chunks.append(cur)
            cur, words = [], 0
        cur.append(p)
        words += len(p.split())
    if cur:
        chunks.append(cur)
    out = []
    for c in chunks:
        q = rng.choice(QUESTIONS)
        out.append((q.format(t=heading, l=low), "\n\n".join(c), heading if q == "{t}" else low))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--py-sources", default=PY_SOURCES)
    ap.add_argument("--debref", default=DEBREF)
    ap.add_argument("--titled", action="store_true",
                    help="each training/held-out answer starts with its topic as the question "
                         "spells it, then ': ' (\"logging: This module defines...\"); "
                         "heldout_plain.txt, the tokenizer corpus and words.txt are unchanged")
    a = ap.parse_args()
    if not os.path.isdir(a.py_sources) or not os.path.exists(a.debref):
        raise SystemExit("missing sources: apt-get install -y --no-install-recommends "
                         "python3.11-doc debian-reference-en")
    sections = []
    for path in sorted(glob.glob(os.path.join(a.py_sources, "**", "*.rst.txt"), recursive=True)):
        if "/whatsnew/" in path or "/c-api/" in path:
            continue  # change logs and C API: lists of names, little prose
        with open(path, encoding="utf-8", errors="replace") as f:
            sections += rst_sections(f.read())
    with gzip.open(a.debref, "rt", encoding="utf-8", errors="replace") as f:
        sections += debref_sections(f.read())
    sections = [(h, p) for h, p in sections if usable_heading(h)]
    rng = random.Random(a.seed)
    rng.shuffle(sections)
    os.makedirs(a.out, exist_ok=True)
    train, held, held_plain, corpus = [], [], [], []
    corpus_bytes = 0
    train_plain = []  # the untitled samples: words.txt counts these
    for k, (h, paras) in enumerate(sections):
        for q, ans, topic in samples(h, paras, rng):
            plain = f"{BOS}{USER}{q}{ASSISTANT}{THINK_END}{ans}{EOS}"
            shown = f"{topic}: {ans}" if a.titled else ans
            s = f"{BOS}{USER}{q}{ASSISTANT}{THINK_END}{shown}{EOS}"
            if k % 50 == 0:
                held.append(s)
                held_plain.append(ans)
            else:
                train.append(s)
                train_plain.append(plain)
                if corpus_bytes < 3_000_000:
                    corpus.append(q + "\n" + ans)
                    corpus_bytes += len(q) + len(ans) + 2
    for name, items, sep in (("train.txt", train, ""), ("heldout.txt", held, ""),
                             ("heldout_plain.txt", held_plain, "\n\n"),
                             ("tokenizer_corpus.txt", corpus, "\n\n")):
        with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
            f.write(sep.join(items))
    counts = {}
    for item in train_plain:
        for w in re.findall(r"[A-Za-z]+", re.sub(r"<｜[^｜]*｜>|</think>", " ", item)):
            counts[w.lower()] = counts.get(w.lower(), 0) + 1
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5000]
    with open(os.path.join(a.out, "words.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(w for w, _ in top) + "\n")
    print(f"prep_data: {len(sections)} sections, train {len(train)} samples "
          f"({sum(map(len, train)) / 1e6:.1f} MB), held-out {len(held)}")


if __name__ == "__main__":
    main()
