"""fastmoe_xpu.settings: every FASTMOE_* switch parsed once, validated, and re-readable for tests."""
import pytest
import torch

from fastmoe_xpu import settings
from fastmoe_xpu.kernels import configs
from fastmoe_xpu.kernels.registry import resolve_backend


def test_defaults_without_variables():
    s = settings.read({})
    assert s == settings.Settings()
    assert (s.cpu_cache, s.cpu_cache_idle_mb, s.cpu_csr, s.cpu_piece_mb) == (True, 4096.0, True, 4)


def test_every_variable_is_read():
    env = {
        "FASTMOE_BACKEND": "Triton", "FASTMOE_TRITON_CONFIGS": "xpu", "FASTMOE_TRITON_BLOCK_PTR": "0",
        "FASTMOE_CPU_CACHE": "off", "FASTMOE_CPU_CACHE_IDLE_MB": "512", "FASTMOE_CPU_CSR": "0",
        "FASTMOE_CPU_PIECE_MB": "8", "FASTMOE_DIST_BACKEND": "GLOO", "FASTMOE_DATA_CACHE": "/tmp/d",
        "FASTMOE_GEMM_ENGINE": "Grouped_MM", "FASTMOE_GEMM_CACHE": "/tmp/g.json",
        "FASTMOE_EXPERT_PRECISION": "INT8", "FASTMOE_KEPT_CONFIGS": "off", "FASTMOE_INT8_WEIGHT_GRADS": "BF16",
    }
    assert set(env) == set(settings.ENV_NAMES.values())
    s = settings.read(env)
    assert s == settings.Settings("triton", "xpu", False, False, 512.0, False, 8, "gloo", "/tmp/d",
                                 "grouped_mm", "/tmp/g.json", "int8", False, "bf16")


@pytest.mark.parametrize("name,value", [
    ("FASTMOE_BACKEND", "cuda"),  # a device, not a kernel backend
    ("FASTMOE_TRITON_CONFIGS", "sm90"),
    ("FASTMOE_CPU_CSR", "maybe"),
    ("FASTMOE_CPU_CACHE_IDLE_MB", "lots"),
    ("FASTMOE_CPU_PIECE_MB", "-1"),
    ("FASTMOE_GEMM_ENGINE", "cutlass"),
    ("FASTMOE_EXPERT_PRECISION", "int4"),
    ("FASTMOE_INT8_WEIGHT_GRADS", "fp16"),
])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        settings.read({name: value})


def test_reloaded_and_override_restore_the_previous_settings(monkeypatch):
    before = settings.get()
    monkeypatch.setenv("FASTMOE_BACKEND", "torch")
    with settings.reloaded() as s:
        assert s.backend == "torch" and settings.get() is s
    with settings.override(cpu_piece_mb=1):
        assert settings.get().cpu_piece_mb == 1
    assert settings.get() is before
    with pytest.raises(TypeError, match="unknown setting"):
        settings.override(no_such_switch=1)


def test_one_decision_for_backend_table_and_block_pointers():
    cpu = torch.device("cpu")
    with settings.override(backend=None, triton_configs=None):
        assert resolve_backend("auto", cpu) == "torch"
        assert configs.table_for(cpu) == "interpreter"
    with settings.override(backend="torch"):
        assert resolve_backend("auto", cpu) == "torch"
    with configs.use("hip"):
        assert configs.table_for(cpu) == "hip"
    with settings.override(triton_block_ptr=False):
        assert not configs.uses_block_ptr("xpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", cpu)


@pytest.mark.parametrize("capability,table", [((9, 0), "cuda"), ((10, 0), "sm100"), ((10, 3), "sm100"),
                                              ((12, 0), "cuda"), ((8, 0), "cuda")])
def test_blackwell_data_center_gpus_get_the_sm100_table(monkeypatch, capability, table):
    """An NVIDIA GPU of compute capability 10.x (B200, GB200, B300) gets the ``sm100`` config table;
    Hopper, Ampere and consumer Blackwell (12.x: no tcgen05, less shared memory) the ``cuda`` one;
    ``FASTMOE_TRITON_CONFIGS`` still decides when set; fp32 dots take TF32 on both exactly where PyTorch
    allows it. (The capability is faked: no GPU needed.)"""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    configs._cuda_table.cache_clear()
    try:
        with settings.override(triton_configs=None):
            assert configs.table_for(torch.device("cuda", 0)) == table
        with configs.use("cuda"):
            assert configs.table_for(torch.device("cuda", 0)) == "cuda"
    finally:
        configs._cuda_table.cache_clear()
    # fp32 operands take TF32 on either NVIDIA table exactly where PyTorch allows it for matmuls
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for allowed, want in ((True, "tf32"), (False, "ieee")):
            torch.backends.cuda.matmul.allow_tf32 = allowed
            assert configs.dot_precision(table, torch.float32) == want
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
