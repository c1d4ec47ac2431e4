"""The one table of numerical tolerances the tests use: (rtol, atol) per dtype."""
import torch

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32, msg: str = "") -> None:
    """Relative comparison scaled by the expected tensor's magnitude (sums of many products make
    elementwise rtol too strict where single entries cancel to near zero)."""
    tol = TOL[dtype]
    scale = expected.detach().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().float(), expected.detach().float(), rtol=tol["rtol"], atol=tol["atol"] + tol["rtol"] * scale,
        msg=lambda m: f"{msg}: {m}",
    )
