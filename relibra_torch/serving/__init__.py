"""MoE serving: ExpertPlex-style expert servers shared by prefill and decode.

``tiles`` holds the tile-footprint rule and the per-layer decode share that both the goodput
model (``relibra serve-sim``) and the runtime's persistent two-phase grouped GEMM use, so the
two cannot disagree. The rest is the goodput model (docs/serving.md): ``requests`` (traces),
``constants`` (cited constants), ``routing`` (tile tables), ``cost`` (roofline iteration
cost), ``engine`` (event engine), ``systems`` (the compared systems), ``goodput`` (P90
goodput search), ``compare``, ``report`` and ``cli``. Only the ``relibra`` entry point
names this package; it imports ``planning``, ``replay`` and ``sim`` (presets, traces).
"""
