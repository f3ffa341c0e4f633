"""Every `python -m training.prepare` command in the docs parses with the real parser."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import REPO

from training.prepare import build_parser

DOCS = ("docs/data.md", "docs/tokenizer.md", "README.md")


def documented_commands() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = (REPO / doc).read_text(encoding="utf-8").replace("\\\n", " ")
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if "-m training.prepare" in line:
                    out.append((doc, line.split("-m training.prepare", 1)[1]))
    return out


def test_docs_have_the_commands():
    docs = {d for d, _ in documented_commands()}
    assert "docs/data.md" in docs and len(documented_commands()) >= 10


@pytest.mark.parametrize(("doc", "args"), documented_commands(), ids=lambda x: x if len(x) < 40 else x[:40])
def test_documented_command_parses(doc, args):
    ns = build_parser().parse_args(shlex.split(args))
    assert ns.command == "merge" or (ns.input and ns.out), (doc, args)
