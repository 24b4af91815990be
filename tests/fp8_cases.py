"""Hard inputs for fp32 -> e4m3 conversions, shared by the CPU and GPU suites."""

import torch


def e4m3_hard_cases(device="cpu") -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties to even), values
    one fp32 ulp off the midpoints, the subnormal range, saturation, +-0, inf, NaN, and
    random values over seven decades, with both signs."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # sorted
    mids = (grid[1:] + grid[:-1]) / 2
    base = torch.cat([grid, mids, mids.nextafter(torch.tensor(float("inf"))),
                      mids.nextafter(torch.tensor(-float("inf")))])
    extra = torch.tensor([0.0, 1e-45, 1e-39, 2.0**-10, 2.0**-10 * 1.0001, 2.0**-7, 447.9, 448.0, 456.0, 460.0, 464.0,
                          500.0, 1e30, float("inf"), float("nan")])
    v = torch.cat([base, -base, extra, -extra, torch.randn(4000) * torch.logspace(-4, 3, 4000)])
    return v.to(device)
