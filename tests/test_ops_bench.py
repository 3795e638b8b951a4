"""benchmarks/kernels.py: the --cpu-smoke run (torch reference path, tiny shapes) and the
no-CUDA exit. The GPU run itself is not a test. Budget: ~3 s."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("relibra_bench_kernels", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_smoke_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    result = _load().main(["--cpu-smoke", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "grouped GEMM" in printed and "permute / unpermute" in printed
    saved = json.loads(out.read_text())
    assert saved["cpu_smoke"] is True and saved["summary"]["gemm_errors"] == 0
    # 1 model x 1 slot count x 1 row count x 2 distributions x 2 projections x 3 passes
    assert len(saved["grouped_gemm"]) == 12
    assert {r["pass"] for r in saved["grouped_gemm"]} == {"fwd", "dX", "dW"}
    for r in saved["grouped_gemm"]:
        assert r["impl"] == "torch-reference" and r["rel_err"] < 1e-6 and r["ratio"] > 0
    assert {r["op"] for r in saved["permute"]} == {"permute_index", "permute_rows", "permute", "unpermute"}
    assert all(r["bandwidth"] > 0 for r in saved["permute"])
    assert result["summary"] == saved["summary"]


def test_group_sizes_sum_and_skew():
    mod = _load()
    assert mod.group_sizes(4096, 8, "balanced") == [512] * 8
    skewed = mod.group_sizes(65536, 32, "skewed")
    assert sum(skewed) == 65536 and len(skewed) == 32
    assert 0 in skewed and max(skewed) > 4 * 65536 // 32


def test_without_cuda_exits_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*--cpu-smoke"):
        _load().main(["--json", str(tmp_path / "k.json")])


@pytest.mark.parametrize("name,want", [
    ("NVIDIA H200", 4.8e12),  # not "H20" (4.0 TB/s): whole words only
    ("NVIDIA H20", 4.0e12),
    ("NVIDIA H200 NVL", 4.8e12),
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H100 PCIe", 2.0e12),  # the most specific entry wins over "H100"
    ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12),
    ("NVIDIA A100-SXM4-40GB", 1.555e12),
    ("NVIDIA A100-PCIE-40GB", 1.555e12),
    ("NVIDIA A100 80GB PCIe", 1.935e12),
    ("NVIDIA B200", 8.0e12),
    ("NVIDIA H800 PCIe", None),  # a board the table does not list: unknown, not the SXM figure
    ("NVIDIA GH200 480GB", None),  # "H200" is not a word of it
    ("NVIDIA GeForce RTX 4090", None),
])
def test_spec_bandwidth_matches_whole_model_names(name, want):
    assert _load().spec_bandwidth(name) == want

