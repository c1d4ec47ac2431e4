import os
import sys

# Tests import the package from the checkout without an install step too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Shared helpers (tolerances, trainer_util, parallel_util) import by plain name from test subfolders too.
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

# Triton kernels run on CPU tensors under Triton's interpreter, which triton fixes when it is first
# imported (torch._dynamo imports it while transformers loads): switch it on before any test module.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    # multi-process fault drills (tests/test_elastic_drills.py): `pytest -m drill` runs them alone
    config.addinivalue_line("markers", "drill: multi-node fault drill under trainer.launch (seconds to a minute each)")
