"""ExpertPlex runtime: expert ranks shared by prefill and decode (see docs/serving.md, the runtime).

* ``share``: the decode share of the persistent two-phase GEMM (one pure function);
* ``claims``: the event model of the two-phase claim rule;
* ``calibration``: the measured tile time of ``make gpu-check`` for the serving model.
"""
