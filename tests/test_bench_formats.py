"""bench/formats.py: its usage errors are one line before any model is built (the timings are the bench's)."""

from __future__ import annotations

import pytest

from bench.formats import main


@pytest.mark.parametrize("argv, says", [
    (["--formats", "fp32,int3"], "unknown format(s) int3"),
    (["--prompt-tokens", "1010"], "--prompt-tokens (1010) must be >= 1 and leave room for --new-tokens (24)"),
    (["--prompt-tokens", "0"], "--prompt-tokens (0) must be >= 1"),
    (["--prompt-tokens", "300", "--length-spread", "300"], "--length-spread (300) must be >= 0 and below"),
    (["--length-spread", "-1"], "--length-spread (-1) must be >= 0"),
])
def test_bad_arguments_are_one_line_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and err[-1].startswith("python -m bench.formats: error:")
