"""The README's own commands: every quoted output is what its command prints today
(bench/readme_samples.py; `--write` remakes the quotes after the default model
changes), and the "From Python" example runs."""
import re
import subprocess
import sys

import pytest

from bench import readme_samples as rs

BLOCKS = rs.samples(rs.README.read_text())


def test_the_readme_has_samples():
    assert BLOCKS and all(cmd.startswith("python ") for cmd, _ in BLOCKS)


@pytest.mark.parametrize("command,quote", BLOCKS, ids=[c for c, _ in BLOCKS])
def test_quoted_output_is_the_commands(command, quote):
    assert rs.folded(rs.run(command)) == rs.folded(quote)


def test_quotes_round_trip_and_a_changed_quote_is_stale():
    text = "intro\n<!-- sample: python -c \"print('a b')\" -->\n> old\n<!-- /sample -->\nafter\n"
    ((command, quote),) = rs.samples(text)
    assert quote == "old" and rs.folded(rs.run(command)) == "a b" != rs.folded(quote)   # negative control
    para = "word " * 40 + "\nsecond paragraph"
    assert rs.folded(rs.unquote(rs.quoted(para))) == rs.folded(para)
    assert all(len(line) <= rs.WIDTH for line in rs.quoted(para).splitlines())


def test_the_from_python_example_runs():
    text = rs.README.read_text()
    section = text[text.index("## From Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=rs.README.parent, env=rs.clean_env())
    assert out.returncode == 0, out.stderr[-2000:]
    # generate(..., "Elizabeth was", max_tokens=48, seed=2) prints the first quote: the CLI's text
    assert rs.folded(out.stdout).startswith(rs.folded(BLOCKS[0][1]))
    assert out.stdout.strip().splitlines()[-1].startswith("length: 24 tokens")
