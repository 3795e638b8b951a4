"""What ``relibra simulate`` checks before it starts, the progress it prints while it runs, and
how both commands write their JSON.

A run can take minutes (trace generation, planners over many steps), so every option that
can be checked up front is: the ``--json`` / ``--plot`` paths (extension, a writable folder,
not a folder themselves) and ``--warmup-steps`` against the steps the trace or the file
holds. While it runs, progress goes to stderr: rich's bar on a terminal, plain lines (phase,
step, seconds elapsed) when stderr is a pipe or a log, so a logged run is never silent.
"""

from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["OUTPUT_SUFFIXES", "check_output_path", "file_steps", "check_warmup", "PlainProgress",
           "refuse_synthetic_options", "write_json"]

# --plot: the formats write_plot's matplotlib writes without extra packages
OUTPUT_SUFFIXES = {"json": (".json",), "plot": (".png", ".svg", ".pdf")}


def check_output_path(option: str, path: str | None) -> None:
    """Raise ``ValueError`` naming ``--json`` / ``--plot`` when ``path`` cannot be written.

    Allowed: the option's extension (:data:`OUTPUT_SUFFIXES`), not an existing folder, and
    the nearest existing folder above it writable (missing folders are created on write).
    """
    if path is None:
        return
    suffixes = OUTPUT_SUFFIXES[option]
    flag = f"--{option}"
    text = str(path)
    if os.path.isdir(text):
        raise ValueError(f"{flag} {text!r} is a folder; pass a file name such as {os.path.join(text, 'out' + suffixes[0])!r}")
    if not text.lower().endswith(suffixes):
        raise ValueError(f"{flag} {text!r} has the wrong extension; allowed: {', '.join(suffixes)}")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise ValueError(f"{flag} {text!r} exists and is not writable")
    folder = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {text!r}: {folder!r} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {text!r}: the folder {folder!r} is not writable")


def write_json(doc: dict, path: str, indent: int = 2) -> None:
    """Write ``doc`` to ``path`` as JSON (parent folders created), atomically
    (:func:`relibra_torch.replay.fileio.replace_atomically`): the text is made first, so a
    non-finite number fails before any file is touched, and a failed write never leaves half
    a file. A failure the checks before the run could not foresee (a full disk, a special file
    system) names ``--json``."""
    from ..replay.fileio import replace_atomically

    text = json.dumps(doc, indent=indent, allow_nan=False) + "\n"

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        replace_atomically(path, write)
    except OSError as exc:
        raise ValueError(f"--json {path!r} cannot be written: {exc.strerror or exc} (the tables above are "
                         f"complete)") from None


def file_steps(path: str) -> int:
    """Recorded steps of a loads file (its first dim) or a routing file (distinct
    ``sample_step`` values, 1 without that tensor), reading only the header and ``sample_step``."""
    from ..replay import LOADS_FORMAT
    from ..replay.fileio import read_header, read_tensors
    header = read_header(path)
    if header.metadata.get("format") == LOADS_FORMAT:
        return header.shape("loads")[0]
    if "sample_step" not in header.tensors:
        return 1
    import torch
    return int(torch.unique(read_tensors(header, ["sample_step"])["sample_step"]).numel())


def refuse_synthetic_options(file: str, opts: dict, given: set[str]) -> None:
    """Options that shape the synthetic trace given with a file (``given``: the ``simulate``
    options set on the command line or in ``--config``): an error naming them; so is
    ``--micro-batches`` other than a loads file's own (it fixes its micro-batches; a routing
    file is packed into ``--micro-batches``)."""
    named = [f"--{k.replace('_', '-')}" for k in ("steps", "micro_batch_tokens", "seed") if k in given]
    if opts["trace"] != "default":
        named.insert(0, f"--trace {opts['trace']}")
    if opts["skew"] != 1.0:
        named.append(f"--set trace.skew={opts['skew']:g}")
    if named:
        one = len(named) == 1
        raise ValueError(f"{', '.join(named)} {'shapes' if one else 'shape'} the synthetic trace; "
                         f"{'it does' if one else 'they do'} not apply to the file {file!r}, which holds "
                         f"its own routing, steps and tokens (drop {'it' if one else 'them'} or the file)")
    if "micro_batches" in given:
        from ..replay import LOADS_FORMAT
        from ..replay.fileio import read_header
        header = read_header(file)
        shape = header.shape("loads") if "loads" in header.tensors else ()
        if header.metadata.get("format") == LOADS_FORMAT and len(shape) == 5 and shape[1] != opts["micro_batches"]:
            raise ValueError(f"--micro-batches {opts['micro_batches']} does not apply to the loads file {file!r}, "
                             f"which holds {shape[1]} micro-batches per step (drop --micro-batches; a routing "
                             f"replay file is packed into --micro-batches)")


def check_warmup(warmup: int | None, steps: int, source: str) -> None:
    """``--warmup-steps`` must leave a measured step of the ``steps`` that ``source`` holds."""
    if warmup is not None and warmup >= steps:
        raise ValueError(f"--warmup-steps {warmup} leaves no measured step: {source} holds {steps} step(s); "
                         f"allowed: 0..{steps - 1}")


class PlainProgress:
    """Progress lines for a stderr that is not a terminal: ``relibra simulate: 12.3 s: PHASE``.

    Called as ``progress(system, steps_done, steps_total)`` by :func:`simulate`; prints the
    first and last step of each system and otherwise at most one line per ``every_s``
    seconds, so a long file does not flood the log.
    """

    def __init__(self, stream=None, every_s: float = 10.0, prefix: str = "relibra simulate"):
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.prefix = prefix
        self.t0 = time.perf_counter()
        self.last = -float("inf")

    def phase(self, text: str) -> None:
        now = time.perf_counter()
        self.last = now
        print(f"{self.prefix}: {now - self.t0:.1f} s: {text}", file=self.stream, flush=True)

    def __call__(self, system: str, done: int, total: int) -> None:
        if done in (1, total) or time.perf_counter() - self.last >= self.every_s:
            self.phase(f"planning {system}: step {done}/{total}")
