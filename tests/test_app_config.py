"""app/config.py: every `Settings` field is a flag of `python -m app` (generated, app/__main__.py) and a row of
docs/api.md's settings table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from app.__main__ import parse_args
from app.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_docs_settings_table_lists_every_field_with_its_flag():
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## Settings"):]
    rows = {m.group(1).lower(): m.group(2) for m in re.finditer(r"^\| `GPT_([A-Z0-9_]+)` \|([^|]*)\|", section, re.M)}
    missing = [n for n in Settings.model_fields if n not in rows]
    assert not missing, f"docs/api.md's settings table has no row for {missing}"
    no_flag = [n for n in Settings.model_fields if f"`{flag(n)}`" not in rows[n]]
    assert not no_flag, f"docs/api.md's settings table shows no flag for {no_flag}"


def test_help_lists_every_field_as_a_flag():
    out = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    missing = [n for n in Settings.model_fields if flag(n) not in out.stdout]
    assert not missing, f"python -m app --help lists no flag for {missing}"
    assert "GPT_PORT" in out.stdout and "--no-prefix-cache" in out.stdout


def test_generated_flags_reach_every_kind_of_field():
    args = parse_args(["--no-warmup", "--cuda-graphs", "--kv-cache-memory-fraction", "0.25", "--cors-origins",
                       "https://a.example,https://b.example", "--dtype", "fp32", "--api-key", "k"])
    s = load_settings(**{k: v for k, v in vars(args).items() if v is not None})
    assert (s.warmup, s.cuda_graphs, s.kv_cache_memory_fraction, s.cors_origins, s.dtype) == (
        False, True, 0.25, ["https://a.example", "https://b.example"], "fp32")
    assert s.api_key.get_secret_value() == "k"
    assert all(v is None for v in vars(parse_args([])).values())  # an unset flag leaves the environment's value


def test_settings_that_do_not_go_together_are_one_line_naming_them():
    import pytest

    from app.config import SettingsError

    # several fronts share a core in its own process: with the core in a thread the launcher failed with an
    # AttributeError traceback after loading the model
    with pytest.raises(SettingsError) as e:
        load_settings(engine="thread", api_servers=2)
    assert str(e.value) == ("invalid settings: api_servers (2) needs engine=process (--api-servers and --engine, "
                            "env GPT_API_SERVERS and GPT_ENGINE): several HTTP fronts share the engine core's process")
    # a check across settings names them, not an empty field ("invalid setting  (-- or env GPT_)")
    with pytest.raises(SettingsError) as e:
        load_settings(speculative_ngram_min=5, speculative_ngram_max=3)
    assert str(e.value) == "invalid settings: speculative_ngram_min (5) must be <= speculative_ngram_max (3)"


def test_the_settings_parse_without_torch():
    """`python -m app` starts the engine core right after parsing its settings, before it imports torch and the
    HTTP stack, so the two load side by side (app/__main__.py): importing the settings must not pull torch in."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, app.config, engine.core_process; from app.config import load_settings; "
            "load_settings(checkpoint='checkpoints/shakespeare'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
