"""README's code blocks: every fence pairs up (an opening fence names its language, a closing one is bare) and every
Python block compiles. A lost opening fence (session 75's edit dropped one) turned an example into prose and the prose
after it into a code block, which no other test saw."""

from __future__ import annotations

from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, code) of each fenced block; a fence out of order raises ValueError."""
    blocks, opened, language, body = [], None, "", []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("```"):
            if opened is not None:
                body.append(line)
            continue
        tag = line[3:].strip()
        if opened is None:
            if not tag:
                raise ValueError(f"line {number}: an opening fence without a language (a closing fence out of place?)")
            opened, language, body = number, tag, []
        else:
            if tag:
                raise ValueError(f"line {number}: fence '{line}' inside the block opened at line {opened}")
            blocks.append((opened, language, "\n".join(body)))
            opened = None
    if opened is not None:
        raise ValueError(f"the block opened at line {opened} is never closed")
    return blocks


def test_fences_pair_up_and_name_their_language():
    blocks = code_blocks(README.read_text())
    assert {"python", "bash"} <= {language for _, language, _ in blocks}


@pytest.mark.parametrize("text", [
    "```python\nx = 1\n",                       # never closed
    "```\nx = 1\n```\n",                        # an opening fence without a language
    "```python\nx = 1\n```bash\nls\n```\n",     # a tagged fence inside a block
    "text\n\nx = 1\n```\n\nprose\n\n```bash\nls\n```\n",  # the lost opening fence of session 75
])
def test_misplaced_fences_are_found(text):
    with pytest.raises(ValueError):
        code_blocks(text)


def test_python_blocks_compile():
    python = [(line, code) for line, language, code in code_blocks(README.read_text()) if language == "python"]
    assert python
    for line, code in python:
        compile(code, f"README.md, the block at line {line}", "exec")
