"""bench/token_cost.py's pure parts: operator kinds and its refusals (the timings themselves are bench output)."""

from __future__ import annotations

import pytest

from bench import token_cost


def test_profiler_operators_are_counted_under_their_kind():
    assert token_cost.kind("aten::addmm") == "matmul"
    assert token_cost.kind("mkldnn::_linear_pointwise") == "matmul"
    assert token_cost.kind("quantized::linear_dynamic") == "matmul"
    assert token_cost.kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert token_cost.kind("## Call CompiledFxGraph fm2wv ##") == "compiled graph"
    assert token_cost.kind("TorchDynamo Cache Lookup") == "guards"
    assert token_cost.kind("aten::copy_") == "other"


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as e:
        token_cost.main(["--compile", "maybe"])
    assert e.value.code == 2 and "--compile takes off and/or on, got maybe" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        token_cost.main(["--checkpoint", "/nonexistent/ckpt"])
    assert e.value.code == 2 and "no such checkpoint directory" in capsys.readouterr().err
