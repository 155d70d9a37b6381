"""hyla bench fp8-gemm's argument errors (the sweep itself needs a GPU: tests/ops/test_fp8_gemm.py
runs every GEMM_SWEEP configuration in the interpreter)."""

import pytest
import torch

from hyla.bench import fp8_gemm


def test_an_unknown_shape_is_refused(capsys):
    with pytest.raises(SystemExit):
        fp8_gemm.main(["--shapes", "no-such-model"])
    assert "invalid choice: 'no-such-model'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so(capsys):
    with pytest.raises(SystemExit):
        fp8_gemm.main([])
    assert "needs a CUDA device" in capsys.readouterr().err
