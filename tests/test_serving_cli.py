"""``relibra serve-sim`` end to end on a short window, its errors, and the serving package's place."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from relibra_torch.cli import build_parser, main
from relibra_torch.serving.cli import setup_from_args

ROOT = Path(__file__).resolve().parents[1]
GLM = str(ROOT / "tests" / "fixtures" / "hf_configs" / "GLM-4.5-Air" / "config.json")


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_serve_sim_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    # min_trace_s=0: the 20 s window is simulated as it is at every rate, not repeated to
    # 60 s (40 s of CPU here; the repetition is tested in test_serving_requests)
    rc = main(["serve-sim", "--model-config", GLM, "--nodes", "1", "--window", "20", "--set", "serving.min_trace_s=0",
               "--systems", "expertplex,pd-disagg,colocated", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "P90 goodput" in text and "expertplex/pd-disagg" in text
    # the paper's 2.01x is its MiniMax-M2.7 figure: never printed next to another model's (GLM-4.5-Air here)
    assert "paper" not in next(ln for ln in text.splitlines() if ln.startswith("expertplex/pd-disagg"))
    doc = json.loads(out.read_text())
    assert doc["setup"]["model"]["num_experts"] == 128 and doc["setup"]["model"]["num_shared_experts"] == 1
    assert set(doc["systems"]) == {"expertplex", "pd-disagg", "colocated"}
    for r in doc["systems"].values():
        assert r["fits"] and r["gpus_used"] <= 8
        if r["goodput"] is not None:
            assert r["goodput_per_gpu"] == pytest.approx(r["goodput"] / 8)
            assert r["goodput_per_node"] == pytest.approx(r["goodput"])
            assert r["attainment"] >= 0.9 and r["ttft_p90_s"] >= r["ttft_p50_s"]
    assert png.stat().st_size > 1000
    assert doc["setup"]["serving"]["min_trace_s"] == 0.0 and doc["setup"]["serving"]["micro_batch_overlap"] == 1.0


def test_bad_trace_is_a_one_line_error_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,-3,4\n")
    assert main(["serve-sim", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bad.csv row 2: ContextTokens = '-3'" in err


@pytest.mark.parametrize("option,message", [
    (["--json", "{tmp}"], "--json '{tmp}' is a folder; pass a file name such as '{tmp}/out.json'"),
    (["--json", "{tmp}/file.json/out.json"],
     "--json '{tmp}/file.json/out.json': '{tmp}/file.json' is a file, not a folder"),
    (["--plot", "{tmp}/out.txt"], "--plot '{tmp}/out.txt' has the wrong extension; allowed: .png, .svg, .pdf"),
    (["--systems", ","], "--systems is empty; allowed: expertplex,pd-colocate,pd-disagg,colocated,chunked-prefill,"
                         "expertplex-repl, or all"),
    (["--seed", "-1"], "--seed = -1; allowed: an int in [0, 9223372036854775807]"),
    (["--window", "-5"], "--window = -5.0; allowed: a finite number > 0 (seconds), or 0 for the rest of the trace"),
])
def test_options_are_checked_before_the_trace_is_read(tmp_path, capsys, option, message):
    # the trace is bad too: an option's error first shows nothing was read (or searched) before it
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,-3,4\n")
    (tmp_path / "file.json").write_text("{}")
    option = [o.format(tmp=tmp_path) for o in option]
    assert main(["serve-sim", "--trace", str(bad), "--systems", "pd-disagg", *option]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.endswith(message.format(tmp=tmp_path)), err


def test_outputs_are_written_into_folders_that_do_not_exist_yet(tmp_path):
    from relibra_torch.serving.report import write_json

    out = tmp_path / "new" / "out.json"
    write_json({"a": 1}, str(out))  # a library call may write into a new folder (the CLI refuses one first)
    assert json.loads(out.read_text()) == {"a": 1}


def test_unknown_system_and_bad_set_are_rejected(capsys):
    assert main(["serve-sim", "--systems", "vllm"]) == 2
    assert "unknown system 'vllm'" in capsys.readouterr().err
    assert main(["serve-sim", "--set", "serving.speed=3"]) == 2
    assert "serving.speed: not a field" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--set", "model.num_experts=100000"], "--set model.num_experts = 100000; allowed: an int in [2, 32767] with "
                                            "the synthetic trace (it stores expert ids as int16); for more experts "
                                            "pass --routing FILE"),
    (["--model-config", "{cfg}"], "--model-config '{cfg}': num_local_experts = 40000; allowed: an int in [2, 32767] "
                                  "with the synthetic trace"),
])
def test_an_expert_count_the_synthetic_routing_cannot_draw_names_the_users_field(tmp_path, capsys, argv, message):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 1024,
                               "intermediate_size": 2048, "num_local_experts": 40000, "num_experts_per_tok": 2,
                               "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000}))
    assert main(["serve-sim", "--systems", "colocated", *[a.format(cfg=cfg) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message.format(cfg=cfg) in err and "TraceConfig" not in err, err


def test_gpu_check_option_prices_the_models_tile_at_the_kernels_measured_rate(tmp_path, capsys):
    """The measured tile is one program's 128 x 128 bf16 output tile over K = 2048 with 132
    programs at once; the model's tile is 64 rows through a whole expert at FP8 (2x bf16): the
    rate carries over, the tile time does not (a model of another width gets its own)."""
    record = {"tile_time_us": 17.0, "tile": [128, 128, 64], "dim": 2048, "programs": 132}
    (tmp_path / "gpu_check.json").write_text(json.dumps({"expertplex": record}))
    rate = 2 * 128 * 128 * 2048 * 132 / 17.0e-6                         # bf16 FLOP/s the kernel reached
    for model, (D, F) in (("minimax-m2", (3072, 1536)), ("qwen3-30b-a3b", (2048, 768))):
        args = build_parser().parse_args(["serve-sim", "--gpu-check", str(tmp_path), "--systems", "colocated",
                                          "--model", model])
        setup = setup_from_args(args)
        assert setup.tile_time_us == pytest.approx(64 * 6 * D * F / (2 * rate) * 1e6, rel=1e-12)
        assert setup.tile_time_source.startswith("measured: the gpu-check kernel's 521 bf16 TFLOP/s as FP8")
    (tmp_path / "gpu_check.json").write_text(json.dumps({"expertplex": {"tile_time_us": 17.0}}))
    assert main(["serve-sim", "--gpu-check", str(tmp_path)]) == 2
    assert "no tile shape, dim and program count beside expertplex.tile_time_us" in capsys.readouterr().err
    (tmp_path / "gpu_check.json").write_text("{}")
    assert main(["serve-sim", "--gpu-check", str(tmp_path)]) == 2
    assert "no positive expertplex.tile_time_us" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--trace", "{burst}"], "its 3 request(s) arrive at one time, so it has no arrival rate to scale; allowed: a "
                             "trace (window) whose arrivals spread over time (widen --window), or --rate R"),
    (["--trace", "{burst}", "--window", "0", "--window-start", "0.5"], "no request in the window"),
    (["--num-requests", "7"], "--num-requests sets how many Poisson requests --rate draws"),
    (["--lengths", "sharegpt", "--window", "20"], "--window / --window-start select part of a trace; --lengths "
                                                  "sharegpt draws its requests"),
    (["--gpu-check", "{null}"], "has no positive expertplex.tile_time_us (got None)"),
    (["--trace", "{mc}", "--json", "{mc}"], "is the trace itself; it would be overwritten"),
    (["--gpu-check", "{note}"], "has no positive expertplex.tile_time_us (got 'skipped: no CUDA')"),
])
def test_options_a_run_would_ignore_and_traces_without_a_rate_are_refused(tmp_path, capsys, argv, message):
    (tmp_path / "burst.csv").write_text(AZURE_HEAD + "2023-11-16 18:15:46.1,5,4\n" * 3)
    (tmp_path / "null.json").write_text('{"expertplex": null}')
    (tmp_path / "note.json").write_text('{"expertplex": "skipped: no CUDA"}')
    (tmp_path / "t.json").write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
                                     '{"timestamp": 900, "input_length": 5, "output_length": 1}\n')
    argv = [a.format(burst=tmp_path / "burst.csv", null=tmp_path / "null.json", note=tmp_path / "note.json",
                     mc=tmp_path / "t.json") for a in argv]
    assert main(["serve-sim", "--systems", "pd-disagg", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_window_start_with_window_0_runs_to_the_end_and_a_configs_notes_are_kept(tmp_path):
    from relibra_torch.sim.hf_config import model_from_hf_config

    trace = tmp_path / "t.csv"
    trace.write_text(AZURE_HEAD + "".join(f"2023-11-16 18:15:{s:02d}.0,100,20\n" for s in range(10, 40)))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 4, "hidden_size": 1024,
                               "intermediate_size": 2048, "num_local_experts": 8, "num_experts_per_tok": 2,
                               "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000,
                               "sliding_window": 4096}))
    args = build_parser().parse_args(["serve-sim", "--trace", str(trace), "--window-start", "20", "--window", "0",
                                      "--model-config", str(cfg)])
    setup = setup_from_args(args)
    assert len(setup.requests) == 10 and setup.requests.source.endswith("[20 s, end)")
    assert setup.model_notes == tuple(model_from_hf_config(str(cfg)).notes) and setup.model_notes  # sliding window


def test_only_the_cli_reaches_the_serving_package():
    bad = []
    for path in (ROOT / "relibra_torch").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        # the serving package itself, and gpu_check's ExpertPlex microbenchmark (it measures the
        # runtime's kernel with the runtime's decode share) use it; the training path never does
        if rel.startswith("relibra_torch/serving/") or rel == "relibra_torch/gpu_check/expertplex.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            if any("serving" in n.split(".") for n in names):
                # the GPU check of the runtime's kernel takes the runtime's share rule (lazily)
                runtime_check = rel == "relibra_torch/gpu_check/expertplex.py" and \
                    names[0] == "relibra_torch.serving.runtime.share"
                if not runtime_check:
                    bad.append(f"{rel}:{node.lineno}")
    assert not bad, ("only relibra_torch/cli.py (by name, lazily) and the runtime's GPU check (its share rule) "
                     "may use relibra_torch.serving: " + ", ".join(bad))
    assert '"serve-sim": "relibra_torch.serving.cli"' in (ROOT / "relibra_torch" / "cli.py").read_text()


def test_a_trace_too_short_for_its_percentile_says_so_and_an_empty_plot_says_why(tmp_path, capsys, recwarn):
    """Fewer requests than a P90 needs (10) leave no percentile below the worst request, and the
    runs repeat them to ``serving.min_trace_s``: the goodput reads as confident as any, so the
    report adds a note. A cluster where no system fits still writes its report, JSON and a
    plot, without a matplotlib warning, and exits 2."""
    from relibra_torch.serving.compare import trace_notes
    from relibra_torch.serving.constants import DEFAULT_CONSTANTS

    assert trace_notes(10, DEFAULT_CONSTANTS) == [] and len(trace_notes(9, DEFAULT_CONSTANTS)) == 1
    trace = tmp_path / "two.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,20\n"
                     "2023-11-16 18:15:47.1805900,200,30\n")
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    rc = main(["serve-sim", "--trace", str(trace), "--window", "0", "--nodes", "1", "--gpus-per-node", "1",
               "--model", "qwen3-30b-a3b", "--systems", "expertplex,pd-disagg", "--jobs", "1",
               "--json", str(out), "--plot", str(png)])
    captured = capsys.readouterr()
    assert rc == 2 and "no system has a configuration that fits" in captured.err
    assert "note: the trace holds 2 request(s), fewer than the 10 a P90 needs" in captured.out
    assert json.loads(out.read_text())["setup"]["notes"][0].startswith("the trace holds 2 request(s)")
    assert png.stat().st_size > 1000 and not [w for w in recwarn if "legend" in str(w.message)]


def test_a_checkpoint_not_stored_in_fp8_is_named_in_a_note(tmp_path):
    src = json.loads((ROOT / "tests" / "fixtures" / "hf_configs" / "Mixtral-8x7B-v0.1" / "config.json").read_text())

    def notes(cfg: dict, *extra: str) -> list[str]:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg))
        args = build_parser().parse_args(["serve-sim", "--model-config", str(path), "--window", "20", *extra])
        return [n for n in setup_from_args(args).model_notes if "checkpoint stores" in n]

    assert notes(src)[0].startswith("the checkpoint stores its weights as bfloat16; the model prices an FP8")
    assert notes({**src, "quantization_config": {"quant_method": "mxfp4"}})[0].startswith(
        "the checkpoint stores its weights as mxfp4")
    assert notes({**src, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == []
    assert notes(src, "--set", "serving.weight_bytes=2") == []
    fp8_groups = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}
    assert notes({**src, "quantization_config": fp8_groups}) == []   # GLM-4.5-Air-FP8's layout
    int4_groups = {**fp8_groups, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}}
    assert notes({**src, "quantization_config": int4_groups})[0].startswith(
        "the checkpoint stores its weights as compressed-tensors")
    folder = build_parser().parse_args(["serve-sim", "--model-config", str(tmp_path), "--window", "20"])
    assert setup_from_args(folder).model_notes          # the folder holding config.json, as --model-config takes


def test_the_default_compares_five_systems_and_all_adds_replication():
    def systems(*argv: str) -> tuple[str, ...]:
        return setup_from_args(build_parser().parse_args(["serve-sim", "--window", "20", *argv])).systems

    assert systems() == ("expertplex", "pd-colocate", "pd-disagg", "colocated", "chunked-prefill")
    assert systems("--systems", "all") == (*systems(), "expertplex-repl")
    assert systems("--systems", "expertplex-repl,pd-disagg") == ("expertplex-repl", "pd-disagg")


def test_serve_sim_fails_when_no_system_fits_and_says_how_much_memory(tmp_path, capsys):
    """DeepSeek-V3 on one GPU: no configuration of any system fits; the row names the weights
    and the memory a GPU holds, and the command exits 2 (nothing was compared)."""
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i:02d}.0000000,{100 + i},20\n" for i in range(12)))
    cfg = str(ROOT / "tests" / "fixtures" / "hf_configs" / "DeepSeek-V3" / "config.json")
    out = tmp_path / "o.json"
    rc = main(["serve-sim", "--model-config", cfg, "--trace", str(trace), "--window", "0", "--nodes", "1",
               "--gpus-per-node", "1", "--systems", "pd-disagg,colocated", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 2
    assert "no system has a configuration that fits" in captured.err
    notes = [r["note"] for r in json.loads(out.read_text())["systems"].values()]
    assert len(notes) == 2 and all("GB of experts" in n and "1 GPUs hold" in n for n in notes)


def test_serve_sim_warns_before_searching_a_trace_in_seconds(tmp_path, capsys):
    """A Mooncake trace whose timestamps look like seconds is named before the search, which
    such a rate makes long, and the progress goes to stderr line by line off a terminal."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i // 2, "input_length": 50, "output_length": 5}) + "\n"
                             for i in range(12)))     # two a millisecond: 2,400 req/s as recorded
    rc = main(["serve-sim", "--trace", str(trace), "--nodes", "1", "--systems", "colocated", "--jobs", "1",
               "--set", "serving.min_trace_s=0"])
    err = capsys.readouterr().err
    assert rc == 0
    warn, done = err.index("warning: the trace arrives at 2,400 req/s"), err.index("colocated done (1/1)")
    assert warn < done
