"""Replicate-and-Quantize at inference on the tiny MoE LM: balance and memory, before/after.

    .venv/bin/python examples/replicate_quantize.py    # about 1.5 min CPU, one thread (docs/inference.md)

1. *Train* (one process, cached in ``--out``): supervised steps on two-digit addition
   ``a+b=`` (10,000 prompts; a fixed 70 % of the (a, b) pairs for training, the rest held
   out).
2. *Calibrate*: greedy generation on ``--calib`` training prompts while
   :func:`relibra_torch.inference.calibrate` measures every expert's load and importance
   (gate-weighted output norm).
3. *Transform* for an EP layout (``--nodes`` x ``--gpus-per-node`` GPUs, ``--replica-slots``
   per GPU) within the original expert memory: resident replicas of heavy experts, int8 for
   the least important ones (:func:`relibra_torch.inference.replicate_and_quantize`).
4. *Measure*, before and after, greedy decoding of ``--held-out`` held-out prompts in
   batches of ``--batch-prompts``: exact-match accuracy (with its binomial standard error and the number of prompts
   whose answer changed), teacher-forced answer loss, per layer the GPU imbalance (max/mean
   token-expert pairs per GPU under the layout, per forward, as the engine splits them
   live) and LIS, and the expert memory.

The run is one process: a transformed layer computes the same on one process as on EP
ranks (``tests/test_inference.py`` checks 4 gloo ranks against one process, including the
per-GPU token counts this script computes with ``gpu_loads``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_lm  # noqa: E402

from relibra_torch.inference import calibrate, gpu_loads, replicate_and_quantize  # noqa: E402
from relibra_torch.moe import moe_layers  # noqa: E402
from relibra_torch.planning import Topology, lis  # noqa: E402

MAX_OPERAND = 99


def model_config() -> tiny_lm.TinyLMConfig:
    return tiny_lm.TinyLMConfig(vocab_size=tiny_lm.Tokenizer().vocab_size, dim=64, hidden_dim=64, n_layers=2,
                                n_heads=4, num_experts=8, top_k=2)


def split_prompts(seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) ``(prompt, answer)`` pairs: a fixed seeded 70/30 split of all (a, b)."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    cut = int(0.7 * len(pairs))
    as_text = [(f"{a}+{b}=", str(a + b)) for a, b in pairs]
    return as_text[:cut], as_text[cut:]


def train(args, train_set, path: str) -> tiny_lm.TinyMoELM:
    torch.manual_seed(args.seed)
    model = tiny_lm.TinyMoELM(model_config())
    if os.path.exists(path):
        model.load_state_dict(torch.load(path))
        print(f"loaded the trained model from {path}")
        return model
    tok, rng = tiny_lm.Tokenizer(), random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.train_steps, pct_start=0.1)
    t0 = time.perf_counter()
    for step in range(args.train_steps):
        batch = rng.sample(train_set, args.batch)
        seqs = [tok.encode(p) + tok.encode(a, bos=False) + [tok.eos] for p, a in batch]
        plens = [len(tok.encode(p)) for p, _ in batch]
        loss = -torch.cat(tiny_lm.sequence_logprobs(model, seqs, plens)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 200 == 0:
            print(f"  train step {step + 1}/{args.train_steps}: loss {loss.item():.4f} "
                  f"({time.perf_counter() - t0:.0f} s)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(model.state_dict(), path)
    return model


def count_forwards(model):
    """Hooks collecting int64 ``[E]`` counts of every forward of every MoE layer."""
    per_layer = []
    handles = []
    for _, layer in moe_layers(model):
        rows: list[torch.Tensor] = []
        per_layer.append(rows)
        handles.append(layer.register_forward_hook(
            lambda m, a, o, rows=rows: rows.append(torch.bincount(m.last_expert_ids_TK.reshape(-1),
                                                                  minlength=m.num_experts))))
    return per_layer, handles


@torch.no_grad()
def measure(model, held_out, slot_expert_LGJ, batch: int) -> dict:
    """Greedy decoding of ``held_out`` in batches of ``batch`` prompts (one forward = one
    prefill or decoding step of a batch), teacher-forced answer loss, per-layer balance."""
    tok = tiny_lm.Tokenizer()
    counts, handles = count_forwards(model)
    answers, lp = [], []
    for i in range(0, len(held_out), batch):
        part = held_out[i : i + batch]
        out = tiny_lm.generate(model, [tok.encode(p) for p, _ in part], 4, eos=tok.eos,
                               generator=torch.Generator(), greedy=True)
        answers += [tok.decode(r) for r in out.responses()]
    for h in handles:
        h.remove()
    for i in range(0, len(held_out), batch):
        part = held_out[i : i + batch]
        seqs = [tok.encode(p) + tok.encode(a, bos=False) + [tok.eos] for p, a in part]
        lp += tiny_lm.sequence_logprobs(model, seqs, [len(tok.encode(p)) for p, _ in part])
    correct = [a == want for a, (_, want) in zip(answers, held_out)]
    layers = []
    for l, rows in enumerate(counts):
        c_FE = torch.stack(rows)  # forwards x experts
        load_FG = torch.stack([gpu_loads(slot_expert_LGJ[l], c) for c in c_FE]).double()
        imb_F = load_FG.max(1).values / load_FG.mean(1)
        lis_F = lis(c_FE)
        w = c_FE.sum(1).double()  # pairs per forward: weights of the token-weighted means
        layers.append({"imbalance": float((imb_F * w).sum() / w.sum()), "imbalance_max": float(imb_F.max()),
                       "lis": float((lis_F * w).sum() / w.sum()), "lis_max": float(lis_F.max()),
                       "lis_all": float(lis(c_FE.sum(0))), "forwards": len(rows)})
    return {"accuracy": sum(correct) / len(correct), "correct": correct,
            "loss": float(-torch.cat(lp).mean()), "layers": layers}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--replica-slots", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64, help="training sequences per step")
    p.add_argument("--calib", type=int, default=256, help="calibration prompts (from the training split)")
    p.add_argument("--held-out", type=int, default=3000, help="held-out prompts (at most 3000)")
    p.add_argument("--batch-prompts", type=int, default=250, help="prompts decoded together (one batch)")
    p.add_argument("--budget", type=float, default=1.0, help="expert memory budget, fraction of the original")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/replicate_quantize")
    args = p.parse_args(argv)
    # One thread: the matrices are tiny (64 x 64 experts), so a second thread only adds
    # synchronisation; on a busy 2-core machine two threads made a training step about 18x
    # slower (6.5 s instead of 0.36 s wall, measured at load average 22).
    torch.set_num_threads(1)
    train_set, held_out = split_prompts(args.seed)
    held_out = held_out[: args.held_out]
    cfg = model_config()
    model = train(args, train_set, os.path.join(args.out, f"model_s{args.seed}_{args.train_steps}x{args.batch}.pt"))
    model.eval()
    topo = Topology(args.nodes, args.gpus_per_node, cfg.num_experts, args.replica_slots)
    native = torch.full((topo.num_gpus, topo.slots_per_gpu), -1, dtype=torch.int64)
    native[:, : topo.experts_per_gpu] = torch.arange(cfg.num_experts).view(topo.num_gpus, -1)
    before = measure(model, held_out, [native] * cfg.n_layers, args.batch_prompts)

    tok = tiny_lm.Tokenizer()
    calib_prompts = [tok.encode(q) for q, _ in random.Random(args.seed + 1).sample(train_set, args.calib)]
    stats = calibrate(model, lambda m: [tiny_lm.generate(m, calib_prompts[i : i + args.batch_prompts], 4, eos=tok.eos,
                                                         generator=torch.Generator(), greedy=True)
                                        for i in range(0, len(calib_prompts), args.batch_prompts)])
    original = sum(p.numel() * p.element_size() for _, l in moe_layers(model) for p in l.expert_params().values())
    budget = int(args.budget * original / cfg.n_layers)
    report = replicate_and_quantize(model, stats, topology=topo, budget_bytes=budget)
    after = measure(model, held_out, [d.slot_expert_GJ for _, d in report.layers], args.batch_prompts)

    n = len(held_out)
    changed = sum(a != b for a, b in zip(before["correct"], after["correct"]))
    se = math.sqrt(before["accuracy"] * (1 - before["accuracy"]) / n)
    print(f"\n{n} held-out prompts, layout {args.nodes} x {args.gpus_per_node} GPUs, R={args.replica_slots}, "
          f"E={cfg.num_experts}, top-{cfg.top_k}, budget {args.budget:.2f} x original expert memory")
    print(f"accuracy  before {100 * before['accuracy']:.2f} %  after {100 * after['accuracy']:.2f} %  "
          f"(binomial SE {100 * se:.2f} points; {changed} prompts changed correctness)")
    print(f"loss      before {before['loss']:.5f}  after {after['loss']:.5f}  "
          f"({100 * (after['loss'] / before['loss'] - 1):+.3f} %)")
    print(f"memory    experts before {original} B, after {report.expert_bytes} B "
          f"({report.expert_bytes / original:.3f} x)")
    print(f"{'layer':>5} {'replicas':>22} {'int8':>16} {'imb before':>11} {'imb after':>10} {'ratio':>6} "
          f"{'LIS before':>11} {'LIS after':>10} {'calib LIS':>10}")
    rows = []
    for l, (_, d) in enumerate(report.layers):
        b, a = before["layers"][l], after["layers"][l]
        reps = [(int(d.slot_expert_GJ[g, j]), g) for g in range(topo.num_gpus)
                for j in range(topo.experts_per_gpu, topo.slots_per_gpu) if d.slot_expert_GJ[g, j] >= 0]
        q = d.quantized_E.nonzero().flatten().tolist()
        rows.append({"before": b, "after": a, "replicas_expert_gpu": reps, "int8_experts": q,
                     "calib_load": stats.load_LE[l].tolist(), "calib_importance": stats.importance_LE[l].tolist(),
                     "expert_bytes": d.expert_bytes, "original_bytes": d.original_bytes})
        print(f"{l:>5} {str(reps):>22} {str(q):>16} {b['imbalance']:>11.3f} {a['imbalance']:>10.3f} "
              f"{b['imbalance'] / a['imbalance']:>6.2f} {b['lis']:>11.3f} {a['lis']:>10.3f} "
              f"{float(lis(stats.load_LE[l])):>10.3f}")
    ib = sum(r["before"]["imbalance"] for r in rows) / len(rows)
    ia = sum(r["after"]["imbalance"] for r in rows) / len(rows)
    print(f"all layers: imbalance before {ib:.3f}, after {ia:.3f}: {ib / ia:.2f}x lower")
    result = {"config": vars(args), "held_out": n, "accuracy_before": before["accuracy"],
              "accuracy_after": after["accuracy"], "accuracy_se": se, "changed": changed,
              "loss_before": before["loss"], "loss_after": after["loss"], "expert_bytes_before": original,
              "expert_bytes_after": report.expert_bytes, "imbalance_ratio": ib / ia, "layers": rows}
    with open(os.path.join(args.out, "result.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
