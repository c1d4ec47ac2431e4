"""Tools off the training path: compile gates (``compile_check``: sm_90 and gfx942;
``compile_xpu``: Intel PVC, with ``xpu_probe``'s probe kernels), the shared ``kernel_specs``, and
``config_sweep`` (fills the kept Triton config table of a GPU)
(the launch and host-sync audit, which compares with the benchmark's baseline, is ``bench.studies.audit``). They import the package; nothing in the package imports them.
Run them as ``python -m fastmoe_xpu.tools.<name>``."""
