"""bench/lm_eval_formats.py: the held-out next-line task and the comparison against fp32 (the lm-eval runs
themselves are the bench's, not the fast suite's)."""

from __future__ import annotations

import pytest

from bench.formats import SHAKESPEARE
from bench.lm_eval_formats import compare, main, next_line_items

needs_text = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="../shared/data/tinyshakespeare.txt is not here")


@needs_text
def test_items_are_seeded_held_out_lines_with_the_true_next_line_among_four():
    items = next_line_items(20, seed=3)
    assert items == next_line_items(20, seed=3) and items != next_line_items(20, seed=4)
    held_out = SHAKESPEARE.read_bytes()[-111540:].decode("utf-8", errors="ignore")
    lines = [ln for ln in held_out.splitlines() if ln.strip()]
    for it in items:
        context = it["context"].rstrip("\n").split("\n")
        assert len(context) == 3 and len(it["choices"]) == 4 and len(set(it["choices"])) == 4
        start = next(i for i in range(len(lines) - 3) if lines[i:i + 3] == context)
        assert it["choices"][it["answer"]] == lines[start + 3]
    assert len({it["answer"] for it in items}) > 1  # the true line is not always in one place
    assert not any(c.endswith(":") for it in items for c in it["choices"])  # speech, never a speaker's name


def test_compare_reports_the_loglikelihood_deltas_and_the_agreeing_choices():
    ref = [[-1.0, -2.0, -3.0], [-5.0, -4.0, -6.0]]
    got = [[-1.1, -2.0, -3.0], [-3.5, -4.0, -6.0]]  # the second item's choice flips
    assert compare(got, ref) == {"mean_abs_delta_ll": round(1.6 / 6, 5), "max_abs_delta_ll": 1.5,
                                 "same_choice": 0.5}


def test_an_unknown_format_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--formats", "fp32,int3"])
    assert e.value.code == 2
    assert "unknown format(s) int3" in capsys.readouterr().err
