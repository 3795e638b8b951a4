"""MoE serving: ExpertPlex-style expert servers shared by prefill and decode.

``tiles`` holds the tile-footprint rule that both the goodput model (``relibra serve-sim``)
and the runtime's persistent two-phase grouped GEMM use, so the two cannot disagree.
"""
