"""Which model ``relibra simulate`` runs on, and one error for every disagreement with a file.

A file fixes the expert count ``E``, the top-k ``K`` and the MoE-layer count ``L`` (and a
loads file its source ranks ``S``). The rest of the model (hidden size, expert width,
attention, dense layers) comes, in this order, from ``--model-config`` (a Hugging Face
``config.json``), from ``--model`` (or a ``--config`` file's model), from a preset named by
the file's ``model`` metadata, or from the only preset whose ``E``, ``K`` and ``L`` equal
the file's. ``--set model.FIELD=VALUE`` is applied on top in every case. When nothing gives
the dims, or the model and the file disagree, :func:`check_file_model` raises one
``ValueError`` listing every mismatch and the flags that fix it. :func:`resolve_model`
applies the precedence ``--set`` > ``--model-config`` > ``--config`` > ``--model``.

Only the file's safetensors header is read here (no tensor data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .hf_config import model_from_hf_config
from .presets import MODELS, ModelSpec, apply_overrides, get_model, parse_override

__all__ = ["FileShape", "file_shape", "preset_for_file", "resolve_model", "check_file_model", "ep_hint",
           "TRACE_EXPERTS", "check_trace_experts"]

# the expert counts the synthetic trace draws (relibra_torch.sim.traces.TraceConfig stores ids as int16)
TRACE_EXPERTS = (2, 32767)


@dataclass(frozen=True)
class FileShape:
    """What a ``relibra.routing/1`` or ``relibra.loads/1`` header says about the model.

    Attributes:
        kind: ``"routing"`` or ``"loads"``.
        num_experts, top_k, num_moe_layers: ``E``, ``K``, ``L``.
        source_ranks: ``S`` of a loads file (None for routing files).
        model: the file's ``model`` metadata (None when absent).
    """

    path: str
    kind: str
    num_experts: int
    top_k: int
    num_moe_layers: int
    source_ranks: int | None
    model: str | None

    def describe(self) -> str:
        text = f"num_experts={self.num_experts}, top_k={self.top_k}, {self.num_moe_layers} MoE layers"
        return text + (f", {self.source_ranks} source ranks" if self.source_ranks is not None else "")


def file_shape(path: str) -> FileShape:
    """Read ``E``, ``K``, ``L`` (and ``S``) and the model name from a file's header."""
    from .. import replay
    from ..replay.fileio import parse_int_metadata, read_header
    if not os.path.exists(path):
        raise FileNotFoundError(f"REPLAY_OR_LOADS_FILE {path!r} does not exist")
    header = read_header(path)
    meta = header.metadata
    fmt = meta.get("format")
    where = f"file {path!r}"
    needs = {replay.ROUTING_FORMAT: "routed_experts", replay.LOADS_FORMAT: "loads"}.get(fmt)
    if needs is not None and needs not in header.tensors:
        raise ValueError(f"{where}: a {fmt!r} file holds a {needs!r} tensor; this one holds "
                         f"{', '.join(map(repr, sorted(header.tensors))) or 'no tensor'}")
    if fmt == replay.ROUTING_FORMAT:
        return FileShape(path, "routing", parse_int_metadata(meta, "num_experts", where, 1, 2**20),
                         parse_int_metadata(meta, "top_k", where, 1, 2**10),
                         parse_int_metadata(meta, "num_layers", where, 1, 2**16), None, meta.get("model"))
    if fmt == replay.LOADS_FORMAT:
        if len(header.shape("loads")) != 5:
            raise ValueError(f"{where}: loads has shape {list(header.shape('loads'))}; allowed: [steps, "
                             f"micro_batches, num_layers, source_ranks, num_experts]")
        X, M, L, S, E = header.shape("loads")
        return FileShape(path, "loads", E, parse_int_metadata(meta, "top_k", where, 1, 2**10), L, S,
                         meta.get("model"))
    raise ValueError(f"{path!r} has format {fmt!r}; allowed: {replay.ROUTING_FORMAT!r} or "
                     f"{replay.LOADS_FORMAT!r} (relibra convert writes the first from engine responses)")


def _matches(spec: ModelSpec, shape: FileShape) -> bool:
    return (spec.num_experts, spec.top_k, spec.num_moe_layers) == (
        shape.num_experts, shape.top_k, shape.num_moe_layers)


def preset_for_file(shape: FileShape) -> tuple[str | None, str]:
    """The preset to take the dims from when no option names a model.

    Returns ``(preset name or None, how it was chosen)``: the preset named by the file's
    ``model`` metadata (its last path part, case-insensitive), else the only preset whose
    ``E``, ``K`` and ``L`` equal the file's; None when neither gives one.
    """
    if shape.model:
        key = os.path.basename(shape.model.rstrip("/")).lower()
        if key in MODELS:
            return key, f"preset named by the file's model metadata {shape.model!r}"
    fits = [name for name, spec in MODELS.items() if _matches(spec, shape)]
    if len(fits) == 1:
        unknown = (f", standing in for the file's model {shape.model!r}, which is no preset (its own dims: "
                   f"--model-config its config.json)") if shape.model else ""
        return fits[0], f"the only preset with the file's {shape.describe()}{unknown}"
    return None, ""


def _presets_fitting(shape: FileShape) -> list[str]:
    return [name for name, spec in MODELS.items() if _matches(spec, shape)]


def check_file_model(shape: FileShape, spec: ModelSpec | None, named_by: str, num_gpus: int) -> None:
    """Raise one ``ValueError`` listing every disagreement between the file and the model.

    Args:
        shape: the file's :class:`FileShape`.
        spec: the model after every override, or None when nothing gave the dims.
        named_by: how the model was chosen (e.g. ``--model qwen3-30b-a3b``), for the message.
        num_gpus: ``--nodes x --gpus-per-node`` (a loads file's ``S`` must equal it).
    """
    name = os.path.basename(shape.path)
    fits = _presets_fitting(shape)
    fix_model = ["--model-config PATH (the model's Hugging Face config.json)"]
    if fits:
        fix_model.append(f"--model {' or '.join(fits)}")
    disagrees = spec is None or (shape.num_experts, shape.top_k, shape.num_moe_layers) != (
        spec.num_experts, spec.top_k, spec.num_moe_layers) or shape.source_ranks not in (None, num_gpus)
    if disagrees:  # a file that is broken in itself says so first: a fix of the model would not help
        from .. import replay
        (replay.load_loads if shape.kind == "loads" else replay.load_routing)(shape.path)
    if spec is None:
        raise ValueError(f"{name!r} has {shape.describe()} and "
                         f"{'model ' + repr(shape.model) if shape.model else 'no model metadata'}, "
                         f"which names no preset: nothing gives the model's dims; pass "
                         f"{' or '.join(fix_model)}")
    problems, sets = [], []
    for what, field, got, want in (("num_experts", "num_experts", shape.num_experts, spec.num_experts),
                                   ("top_k", "top_k", shape.top_k, spec.top_k),
                                   ("MoE layers", "num_moe_layers", shape.num_moe_layers, spec.num_moe_layers)):
        if got != want:
            problems.append(f"{what} {got} (model: {want})")
            sets.append(f"--set model.{field}={got}")
            if field == "num_moe_layers":  # keep the model's dense layers, if any
                sets.append(f"--set model.num_layers={got + spec.num_dense_layers}")
    if problems:
        fixes = fix_model + [f"{' '.join(sets)} (keeps the other dims of {spec.name})"]
        problems_text = "; ".join(problems)
        raise ValueError(f"{name!r} disagrees with {named_by}: {problems_text}; fix with "
                         f"{' or '.join(fixes)}")
    if shape.source_ranks is not None and shape.source_ranks != num_gpus:
        raise ValueError(f"{name!r} was batched for {shape.source_ranks} ranks but --nodes x "
                         f"--gpus-per-node = {num_gpus}; a loads file is used as batched: pass "
                         f"{_node_choices(shape.source_ranks)}")


def _node_choices(ep: int, gpus_per_node: int = 8, limit: int = 3) -> str:
    """``--nodes N --gpus-per-node G`` choices with ``N * G == ep`` (G <= 8 first)."""
    pairs = [(ep // g, g) for g in range(min(ep, gpus_per_node), 0, -1) if ep % g == 0]
    return " or ".join(f"--nodes {n} --gpus-per-node {g}" for n, g in pairs[:limit])


def ep_hint(num_experts: int, nodes: int, gpus_per_node: int) -> str:
    """Working ``--nodes`` / ``--gpus-per-node`` when ``E`` is not divisible by the EP size.

    Keeps ``--gpus-per-node`` and lowers ``--nodes`` when some node count works; else
    offers one node with the largest GPU count (<= ``gpus_per_node``) that divides ``E``.
    """
    same_gpn = [n for n in range(nodes, 0, -1) if num_experts % (n * gpus_per_node) == 0]
    choices = [f"--nodes {n} --gpus-per-node {gpus_per_node}" for n in same_gpn[:2]]
    if not choices:
        g = max(d for d in range(1, gpus_per_node + 1) if num_experts % d == 0)
        choices.append(f"--nodes 1 --gpus-per-node {g}")
    return " or ".join(choices)


def check_trace_experts(spec: ModelSpec, sets: dict, hf_field: str | None = None, config: str | None = None,
                        config_fields: dict | None = None, fix: str = "a routing replay or loads file") -> None:
    """Refuse an expert count the synthetic trace cannot draw (:data:`TRACE_EXPERTS`), naming
    the field it came from: ``--set model.num_experts`` (``sets``), the ``--model-config``
    field ``hf_field`` (``"--model-config PATH: FIELD"``), or ``--config``'s ``[model]`` table."""
    lo, hi = TRACE_EXPERTS
    E = spec.num_experts
    if lo <= E <= hi:
        return
    if "num_experts" in sets:
        where = "--set model.num_experts"
    elif hf_field:
        where = hf_field
    elif "num_experts" in (config_fields or {}):
        where = f"--config {config!r}: [model] num_experts"
    else:
        where = "model.num_experts"
    raise ValueError(f"{where} = {E}; allowed: an int in [{lo}, {hi}] with the synthetic trace (it stores expert "
                     f"ids as int16); for more experts pass {fix}")


def _sets(args, section: str) -> dict:
    """The ``--set SECTION.FIELD=VALUE`` overrides of one section, in command-line order."""
    sets = {}
    for text in args.set or []:
        sec, name, value = parse_override(text)
        if sec == section:
            sets[name] = value
    return sets


def _config_section(file_cfg: dict, section: str) -> tuple[str | None, dict]:
    """``(preset, fields)`` of a --config file's model or hardware entry."""
    raw = file_cfg.get(section)
    if raw is None:
        return None, {}
    if isinstance(raw, str):
        return raw, {}
    if isinstance(raw, dict):
        return raw.get("preset"), {k: v for k, v in raw.items() if k != "preset"}
    raise ValueError(f"--config: '{section}' must be a preset name or an object of fields")


def resolve_model(args, opts: dict, file_cfg: dict, sim_cfg: dict, shape: FileShape | None) -> tuple:
    """The model spec, how it was chosen, and the approximations its source implies.

    Precedence: --set > --model-config > --config's model > --model; with a file and none of
    them, the preset the file names or fits (:func:`preset_for_file`). ``opts`` are the merged
    simulate options (``model``, ``model_config``), ``sim_cfg`` the config file's simulate table.
    Returns ``(spec or None, named_by, notes)``; None when nothing gives the dims.
    """
    preset, fields_ = _config_section(file_cfg, "model")
    new_name = fields_.pop("name", None)
    notes: tuple[str, ...] = ()
    if opts["model_config"]:
        hf = model_from_hf_config(str(opts["model_config"]))
        base, named_by, notes = hf.spec, f"--model-config {opts['model_config']}", hf.notes
    else:
        if args.model is not None:
            name, named_by = args.model, f"--model {args.model}"
        elif preset is not None or fields_ or "model" in sim_cfg:
            name, named_by = preset or opts["model"], f"--config {args.config}"
        elif shape is not None:
            name, named_by = preset_for_file(shape)
        else:
            name, named_by = opts["model"], f"--model {opts['model']}"
        if name is None:
            return None, "", ()
        base = apply_overrides(get_model(name), "model", fields_)
    spec = apply_overrides(base, "model", _sets(args, "model"))
    original = get_model(spec.name) if spec.name in MODELS and not opts["model_config"] else base
    changed = [f"{f}={getattr(spec, f)}" for f in spec.__dataclass_fields__
               if f != "name" and getattr(spec, f) != getattr(original, f)]
    if shape is None:  # the synthetic trace: its limits, under the user's name for the field
        check_trace_experts(spec, _sets(args, "model"), opts["model_config"] and
                            f"--model-config {opts['model_config']!r}: {hf.experts_field}", args.config, fields_)
    if new_name:
        spec = replace(spec, name=str(new_name))
    elif changed:  # the header must not name a preset whose fields were replaced
        spec = replace(spec, name=f"{spec.name} ({', '.join(changed)})")
    return spec, named_by, notes
