"""The commands of docs/simulator.md's "Your own model and replay" section run as documented.

The test builds what a user would have: the two models' config.json (copies of
tests/fixtures/hf_configs), SGLang /generate responses of a Mixtral-shaped model (32 layers,
top-2 of 8 experts) and vLLM responses of a DeepSeek-V2-Lite-shaped one (26 MoE layers of
27, top-6 of 64); then runs every `relibra` line of the section's bash block in that folder.
A line commented `# exits 2` must fail with exit code 2, the others succeed.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil

import torch
from _replay_helpers import random_ids_TLK

from relibra_torch.cli import main
from relibra_torch.replay import load_routing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section_commands() -> list[str]:
    text = open(os.path.join(ROOT, "docs", "simulator.md"), encoding="utf-8").read()
    section = text.split("## Your own model and replay", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("relibra ")]


def write_inputs(folder) -> None:
    for name in ("Mixtral-8x7B-v0.1", "DeepSeek-V2-Lite"):
        os.makedirs(folder / name)
        shutil.copy(os.path.join(ROOT, "tests", "fixtures", "hf_configs", name, "config.json"), folder / name)
    with open(folder / "responses.jsonl", "w") as fh:  # SGLang: all 32 layers, int32, flat base64
        for i, (prompt, completion) in enumerate(((12, 20), (30, 9), (7, 41), (16, 16))):
            ids = random_ids_TLK(prompt + completion - 1, 32, 2, 8, seed=i, skew=0.5).to(torch.int32)
            meta = {"prompt_tokens": prompt, "completion_tokens": completion,
                    "routed_experts": base64.b64encode(ids.numpy().tobytes()).decode()}
            fh.write(json.dumps({"text": "...", "meta_info": meta}) + "\n")
    responses = []  # vLLM: MoE layers only, prompt rows at the response level, n = 2 choices
    for i in range(3):
        prompt = random_ids_TLK(10 + i, 26, 6, 64, seed=10 + i, skew=0.5)
        choices = [{"index": j, "token_ids": list(range(15 + j)),
                    "routed_experts": random_ids_TLK(14 + j, 26, 6, 64, seed=20 + 2 * i + j, skew=0.5).tolist()}
                   for j in range(2)]
        responses.append({"prompt_token_ids": list(range(10 + i)), "prompt_routed_experts": prompt.tolist(),
                          "choices": choices})
    (folder / "responses.json").write_text(json.dumps(responses))


def test_documented_commands_run(tmp_path, capsys, monkeypatch):
    commands = section_commands()
    assert len(commands) >= 5
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    for line in commands:
        argv = shlex.split(line.split("#", 1)[0])[1:]
        rc = main(argv + (["--no-progress"] if argv[0] == "simulate" else []))
        out = capsys.readouterr()
        assert rc == (2 if "# exits 2" in line else 0), (line, out.err)
        if argv[0] == "simulate" and rc == 0:
            assert out.out.splitlines()[0].startswith(os.path.basename(os.path.dirname(argv[argv.index("--model-config") + 1])))
        if rc == 2:
            assert "pass --model-config PATH" in out.err, out.err
    replay = load_routing("rollout.safetensors")
    assert (replay.num_experts, replay.num_layers, replay.top_k, replay.num_samples) == (8, 32, 2, 4)
    assert replay.num_tokens == (12 + 20 - 1) + (30 + 9 - 1) + (7 + 41 - 1) + (16 + 16 - 1)
    v2 = load_routing("rollout-v2.safetensors")
    assert (v2.num_layers, v2.top_k, v2.num_samples, v2.model) == (26, 6, 6, "DeepSeek-V2-Lite")
