import pytest

from training.jsonl import parse_line


class Bad(ValueError):
    pass


def test_a_line_is_its_value_and_a_blank_line_is_skipped():
    assert parse_line(b'{"a": [1, 2]}\n', "f.jsonl:1", Bad) == {"a": [1, 2]}
    assert parse_line(b"  \n", "f.jsonl:2", Bad) is None


@pytest.mark.parametrize("raw, message", [
    (b'{"a": "\xff"}', r"^f.jsonl:3: invalid UTF-8 at byte 7 of the line$"),
    (b'{"a": 1', r"^f.jsonl:3: not valid JSON \(Expecting ',' delimiter at column 8\)$"),
])
def test_bad_lines_name_the_file_and_line_in_the_callers_error(raw, message):
    with pytest.raises(Bad, match=message):
        parse_line(raw, "f.jsonl:3", Bad)
